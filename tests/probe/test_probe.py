"""`specdoctor probe` against `specdoctor serve` over real sockets, and its readers of vLLM's
Prometheus exposition and SGLang's per-response fields."""

from __future__ import annotations

import http.server
import json
import os
import signal
import threading
import time
import xml.etree.ElementTree as ET

import httpx
import pytest

from specdoctor.errors import SpecdoctorError
from specdoctor.probe import prometheus
from specdoctor.probe.client import KEEPALIVE_S, Probe, acceptance, enable_hint, probe_findings
from specdoctor.probe.options import ProbeOptions
from specdoctor.probe.pace import SAFETY, BudgetSpent, Pace
from specdoctor.runtime.decode.metrics import SpecMetrics
from tests.helpers.servers import SpecdoctorServer as Server
from tests.helpers.servers import free_port, probe

VLLM_SAMPLE = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="glm"} 120.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="glm"} 1.7e+09
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="glm"} 360.0
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="glm"} 1.7e+09
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="glm"} 200.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm",position="0"} 100.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="glm",position="0"} 1.7e+09
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm",position="1"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm",position="2"} 30.0
vllm:num_requests_running{engine="0",model_name="glm"} 0.0
"""


def test_reads_vllm_exposition_with_total_created_and_position_labels():
    metrics = prometheus.spec_counters(prometheus.parse(VLLM_SAMPLE))
    assert metrics == SpecMetrics(120, 360, 200, [100, 70, 30])
    assert metrics.mean_acceptance_length == pytest.approx(1 + 200 / 120)
    assert prometheus.spec_counters(prometheus.parse("vllm:num_requests_running 0\n")) is None
    with pytest.raises(SpecdoctorError, match="http://x/metrics: not Prometheus text exposition"):
        prometheus.parse("<html><body>a proxy's login page</body></html>", "http://x/metrics")


def test_window_uses_differences_and_sglang_uses_verify_counts():
    before = SpecMetrics(100, 300, 150, [80, 50, 20])
    after = SpecMetrics(130, 390, 160, [90, 55, 15 + 5 + 0])
    source, window = acceptance([{"usage": {"completion_tokens": 5}}], before, after)
    assert source == "metrics" and window == SpecMetrics(30, 90, 10, [10, 5, 0])
    sglang = [
        {"usage": {"completion_tokens": 30}, "meta_info": {"spec_verify_ct": 10}},
        {"usage": {"completion_tokens": 10}, "meta_info": {"spec_verify_ct": 10}},
    ]
    source, figures = acceptance(sglang, None, None)
    assert source == "sglang" and figures["mean_acceptance_length"] == 2.0
    chain = probe_findings("metrics", SpecMetrics(100, 300, 90, [85, 5, 0]), 1.4)
    assert any(f.check == "probe.chain" for f in chain)


def test_healthy_server_passes(servers):
    result = probe(servers["healthy"].url, "--json", "-")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["schema"] == "specdoctor.probe/2" and report["model"] == "demo"
    assert report["verdict"]["healthy"] and report["metrics"]["mean_acceptance_length"] >= 2.0


def test_broken_drafter_fails_with_its_signature(servers, tmp_path):
    junit = tmp_path / "probe.xml"
    result = probe(servers["broken"].url, "--json", "-", "--junit-xml", str(junit))
    assert result.returncode == 1
    findings = json.loads(result.stdout)["findings"]
    assert any(f["check"] == "probe.acceptance" and "drafter broken" in f["message"] for f in findings)
    failures = [
        case.get("name") for case in ET.parse(junit).getroot().iter("testcase") if case.find("failure") is not None
    ]
    assert failures == ["probe.acceptance"]


def test_speculative_decoding_off_is_reported(servers):
    result = probe(servers["off"].url, "--json", "-")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    findings = report["findings"]
    assert [f["check"] for f in findings] == ["probe.enabled"] and "not enabled" in findings[0]["message"]
    # The hint names the flag of the engine that /v1/models says serves the model.
    assert report["engine"] == "specdoctor" and "--num-speculative-tokens" in findings[0]["hint"]


def test_each_engine_is_told_its_own_flag():
    assert "--speculative-config" in enable_hint("vllm") and "--speculative-algorithm" in enable_hint("sglang")
    assert all(flag in enable_hint("") for flag in ("--speculative-config", "--speculative-algorithm"))


def test_a_deployment_that_errors_while_decoding_is_a_finding_not_bad_input(tmp_path):
    """A rank dies: the server stays up and answers every completion with an error. The probe judged the
    deployment (exit 1, the error quoted), it did not fail to reach it (exit 2)."""
    server = Server("--pp", "2", "--num-speculative-tokens", "3")
    try:
        os.kill(server.rank_pids[1], signal.SIGKILL)
        result = probe(server.url, "--json", str(tmp_path / "report.json"))
    finally:
        server.stop()
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    errors = [f for f in report["findings"] if f["check"] == "probe.errors"]
    assert errors and "9 of 9 completions failed" in errors[0]["message"] and "answered 50" in errors[0]["message"]
    assert report["battery"] == "0/9 answered" and report["verdict"]["exit_code"] == 1


def test_other_traffic_is_excluded_by_per_request_figures(servers):
    """During the probe another client keeps the server busy: the /metrics window counts both, the
    probe's per-request figures only its own traffic."""
    url = servers["healthy"].url
    stop = threading.Event()

    def other_client():
        while not stop.is_set():
            httpx.post(
                f"{url}/v1/completions", json={"prompt": "while True:", "max_tokens": 8, "temperature": 0}, timeout=60
            )

    before = prometheus.spec_counters(prometheus.parse(httpx.get(f"{url}/metrics").text))
    thread = threading.Thread(target=other_client)
    thread.start()
    try:
        result = probe(url, "--json", "-")
    finally:
        stop.set()
        thread.join(timeout=60)
    after = prometheus.spec_counters(prometheus.parse(httpx.get(f"{url}/metrics").text))
    report = json.loads(result.stdout)
    assert report["source"] == "per-request"
    assert report["metrics"]["num_drafts"] < after.num_drafts - before.num_drafts


def test_unreachable_server_exits_2_and_still_writes_the_json_report():
    result = probe(f"http://127.0.0.1:{free_port()}", "--json", "-")
    assert result.returncode == 2
    assert "cannot reach the server" in result.stderr and "Traceback" not in result.stderr
    report = json.loads(result.stdout)
    assert report["schema"] == "specdoctor.probe/2" and "cannot reach the server" in report["error"]["message"]
    assert report["verdict"] == {"healthy": False, "exit_code": 2, "summary": report["error"]["message"]}


def test_a_server_that_is_not_openai_compatible_exits_2():
    handler = http.server.SimpleHTTPRequestHandler
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        result = probe(f"http://127.0.0.1:{httpd.server_address[1]}")
    finally:
        httpd.shutdown()
    assert result.returncode == 2
    assert "not an OpenAI-compatible server" in result.stderr and len(result.stderr.strip().splitlines()) == 1


class KeepAliveServer(http.server.BaseHTTPRequestHandler):
    """A keep-alive server that drops a request on a kept-alive connection without a reply, as uvicorn does when
    its keep-alive timer closes a connection as the request arrives: with `idle_s` None, every second request on a
    connection (the worst case); else one arriving after `idle_s` idle. Answers anything else `{"data": []}`."""

    protocol_version = "HTTP/1.1"
    idle_s: float | None = None
    requests: list[tuple[int, bool]] = []  # (connection, answered), in arrival order

    def setup(self) -> None:
        super().setup()
        self.served, self.last = 0, time.monotonic()

    def do_GET(self) -> None:
        idle = time.monotonic() - self.last
        dropped = self.served > 0 and (self.idle_s is None or idle >= self.idle_s)
        self.requests.append((id(self), not dropped))
        if dropped:
            self.close_connection = True
            return
        body = b'{"data": []}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.served, self.last = self.served + 1, time.monotonic()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.do_GET()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def keep_alive_server():
    handler = type("Handler", (KeepAliveServer,), {"requests": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_a_get_the_server_drops_on_a_kept_alive_connection_goes_once_more_on_a_new_one(keep_alive_server):
    handler, url = keep_alive_server
    client = Probe(ProbeOptions(url))
    assert [client.get("/metrics").status_code for _ in range(2)] == [200, 200]
    first, dropped, again = handler.requests
    assert dropped == (first[0], False) and again[1] and again[0] != first[0]


def test_a_completion_never_goes_on_a_connection_idle_as_long_as_a_servers_keep_alive(keep_alive_server):
    """A server that drops a request arriving after KEEPALIVE_S + 0.5 s idle (uvicorn's 5 s, scaled down): the
    probe has dropped the connection by then and sends its completion on a new one, once."""
    handler, url = keep_alive_server
    handler.idle_s = KEEPALIVE_S + 0.5
    client = Probe(ProbeOptions(url))
    client.complete("demo", "a")
    time.sleep(handler.idle_s + 0.1)
    assert "error" not in client.complete("demo", "b")
    assert [answered for _, answered in handler.requests] == [True, True]


class Throttled:
    """A server's ranks stopped `stopped_s` out of every `stopped_s + running_s` (SIGSTOP, SIGCONT), as a machine busy
    with other work leaves them a share of the CPU: its requests take `(stopped_s + running_s) / running_s` times as
    long, and nothing else changes."""

    def __init__(self, pids: list[int], stopped_s: float = 0.2, running_s: float = 0.1):
        self.pids, self.stopped_s, self.running_s = pids, stopped_s, running_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.done.is_set():
            self.signal(signal.SIGSTOP)
            self.done.wait(self.stopped_s)
            self.signal(signal.SIGCONT)
            self.done.wait(self.running_s)

    def signal(self, signum: int) -> None:
        for pid in self.pids:
            os.kill(pid, signum)

    def __enter__(self) -> "Throttled":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.signal(signal.SIGCONT)


def test_a_slow_but_healthy_server_is_waited_for_at_its_own_pace(servers):
    """The healthy server at half its speed, and a floor of 1 s a request: requests that take several seconds
    (the sampling sweep's) get what the server's measured pace needs, and every sweep passes (smaller ones than the
    defaults: it is the timeouts that are tested; the reference sweep is the one --all leaves out, saying so)."""
    healthy = servers["healthy"]
    with Throttled(healthy.rank_pids, stopped_s=0.1, running_s=0.1):
        args = ("--all", "--context-lengths", "128,512", "--sweep-prompts", "8", "--concurrency", "1,4")
        args += ("--sampling", "300")
        args += ("--sampling-settings", "1")  # one setting: it is the pace that is tested
        result = probe(healthy.url, *args, "--request-timeout", "1", "--json", "-")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    report = json.loads(result.stdout)
    assert report["verdict"]["healthy"]
    # --all without a reference says the comparison it could not make, rather than leaving it out silently
    said = [f["message"] for f in report["findings"] if f["check"] == "probe.reference"]
    assert said == ["reference: not run (no --reference-url): greedy output was not compared with speculation off"]


def test_the_request_timeout_follows_the_measured_pace_inside_the_budget():
    pace = Pace(floor_s=2.0, budget_s=100.0)
    assert 99 < pace.timeout(32, 1) <= 100  # nothing measured yet: what is left of the budget
    pace.observe(seconds=3.3, tokens=32, in_flight=1)  # 0.1 s a token
    assert pace.timeout(32, 1) == pytest.approx(SAFETY * 0.1 * 33)
    assert pace.timeout(2, 1) == 2.0  # the floor
    assert pace.timeout(32, 4) == pytest.approx(4 * SAFETY * 0.1 * 33)  # 4 in flight, seen only alone: 4 times slower
    pace.observe(seconds=6.6, tokens=32, in_flight=4)  # measured at 4: twice as slow as alone, not four times
    assert pace.timeout(32, 4) == pytest.approx(SAFETY * 0.2 * 33) and pace.timeout(600, 8) > 99  # capped: the budget
    pace.deadline = 0
    with pytest.raises(BudgetSpent):
        pace.timeout(1, 1)
