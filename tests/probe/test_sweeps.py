"""`probe`'s sweeps against real `specdoctor serve` processes: every sweep passes on a healthy server, each
fails on the engine fault it exists to find, and a sweep that cannot run says why and fails the probe."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import httpx
import pytest
import torch

from specdoctor.probe.acceptance_sweeps import PREFIX_MAX_PROMPTS, PREFIX_ROUND, PREFIX_SIZED_FOR, context_lengths
from specdoctor.probe.corpus import STARTS, corpus_prompt, corpus_text
from specdoctor.probe.options import DEFAULT_SAMPLING_TOKENS, SweepOptions
from specdoctor.probe.output_sweeps import divergence
from specdoctor.probe.stats import POWER, calibration_p_value
from specdoctor.runtime.decode.rejection import verify_random
from tests.helpers.browser import images_loaded
from tests.helpers.servers import SpecdoctorServer as Server
from tests.helpers.servers import free_port, probe
from tests.probe.conftest import DUMMY_PAST

SWEEPS = ["context", "prefix-cache", "concurrency", "sampling", "reference", "api"]


def sweeps_of(result: subprocess.CompletedProcess) -> dict[str, dict]:
    return {sweep["name"]: sweep for sweep in json.loads(result.stdout)["sweeps"]}


def junit_cases(path) -> dict[str, bool]:
    """JUnit test case name -> failed."""
    return {case.get("name"): case.find("failure") is not None for case in ET.parse(path).getroot().iter("testcase")}


def test_every_sweep_passes_on_a_healthy_server(servers, tmp_path):
    """PP 2, k 3: three context buckets up to the served 2,048 tokens, the default concurrency levels, sampling,
    and the reference comparison against the same demo served with speculation off."""
    junit, html = tmp_path / "probe.xml", tmp_path / "probe.html"
    reference = servers["off"].url
    args = ("--all", "--context-lengths", "128,512,1500", "--sweep-prompts", "8", "--sampling", "600")
    args += ("--reference-url", reference)
    args += ("--json", "-", "--junit-xml", str(junit))
    args += ("--html", str(html))
    result = probe(servers["healthy"].url, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    sweeps = sweeps_of(result)
    assert list(sweeps) == SWEEPS and all(sweep["status"] == "passed" for sweep in sweeps.values())
    context = sweeps["context"]["points"]
    assert len(context) == 3 and context[-1]["metrics"]["num_drafts"] > 0
    assert int(context[-1]["label"].split()[0].replace(",", "")) > 1000
    assert [p["label"] for p in sweeps["concurrency"]["points"]] == ["1 in flight", "4 in flight", "16 in flight"]
    # temperature 1 and the chat defaults, 600 tokens sampled at each, then as many by the reference at each
    points = sweeps["sampling"]["points"]
    sampling = [p for p in points if p["label"].startswith(servers["healthy"].url)]
    settings = ["temperature 1", "temperature 0.6, top-p 0.95", "temperature 0.8, top-p 0.95"]
    assert [p["setting"] for p in sampling] == settings and all(p["outside"] == 0 for p in sampling)
    assert [p["label"] for p in points if p not in sampling] == [f"{reference} at {s}" for s in settings]
    assert all(p["two_sample_p_value"] >= 0.001 / 3 for p in sampling)
    # the demo's distributions are flat: at 0.6 and 0.8 most steps' nucleus reaches past the reported top 5
    assert all(p["tokens"] + p["undetermined"] >= 600 and p["tokens"] > 0 for p in sampling)
    assert sweeps["reference"]["summary"].endswith("9 of 9 prompts")
    assert {f"probe.{name}": False for name in SWEEPS}.items() <= junit_cases(junit).items()
    # The HTML report in a real browser: the battery's bars, context's curve and bars, the prefix cache's and
    # concurrency's bars, and the sampling calibration at each setting, the reference's too, every one loaded.
    assert images_loaded(html, tmp_path / "profile") == (11, 11)
    # the API sweep as a table: a row per check, its verdict and evidence
    page = html.read_text()
    assert "<th>check</th><th>requests</th><th>verdict</th><th>evidence</th>" in page
    assert "<td>max_tokens mid-run</td>" in page and "<td>passed</td>" in page


@pytest.mark.parametrize(
    ("args", "sweep", "evidence"),
    [
        (("--context-sweep", "--context-lengths", "128,1500", "--sweep-prompts", "8"), "context", "falls off a cliff"),
        (("--concurrency", "1,4"), "concurrency", "falls with concurrency"),
        (("--sampling", "300", "--sampling-settings", "1"), "sampling", "not the target's reported distribution"),
    ],
    ids=["drafter-max-position", "stale-batch-rows", "rejection-reuse-uniform"],
)
def test_each_fault_fails_the_sweep_that_finds_it(servers, args, sweep, evidence):
    result = probe(servers["faulty"].url, *args, "--json", "-")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    report = json.loads(result.stdout)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [f["check"] for f in errors] == [f"probe.{sweep}"] and evidence in errors[0]["message"]
    assert report["sweeps"][0]["status"] == "failed" and errors[0]["hint"]
    if sweep == "context":  # dummy drafts past the fault's length: hardly anything is accepted there
        assert DUMMY_PAST < int(errors[0]["data"]["from"].split()[0].replace(",", ""))  # the bucket's mean length
        assert report["sweeps"][0]["points"][-1]["metrics"]["per_position_acceptance_rate"][0] < 0.1


def test_a_drafter_run_past_its_trained_range_fails_the_context_sweep():
    """No fault: demo-eagle3's head was trained on 128-token sequences, so at 1,500 tokens its attention meets
    distances it never learned, the failure of a drafter run past its trained range (73 % -> 13 % in the reports;
    here 62 % -> 21 % at position 0 over these 8 prompts: a cliff under the broken-drafter limit). The demo and
    demo-dspark keep more of their rate (the healthy server's context sweep passes)."""
    server = Server("--model", "demo-eagle3")
    try:
        result = probe(
            server.url, "--context-sweep", "--context-lengths", "128,1500", "--sweep-prompts", "8", "--json", "-"
        )
    finally:
        server.stop()
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    errors = [f for f in json.loads(result.stdout)["findings"] if f["severity"] == "error"]
    assert [f["check"] for f in errors] == ["probe.context"] and "trained range" in errors[0]["hint"]
    first, last = (
        p["metrics"]["per_position_acceptance_rate"][0] for p in json.loads(result.stdout)["sweeps"][0]["points"]
    )
    assert first > 0.5 and 0.05 < last < first / 2  # a partial fall: drafts still accepted, at a fraction of the rate


def test_a_sampler_at_temperature_1_whatever_was_asked_is_found_alone_and_against_speculation_off(servers):
    """sampling-params-ignored alone, at temperature 0.6 with top-p 0.95 and the default size, against the demo at k 0
    sampling the same. Alone: tokens drawn outside the nucleus of the server's own reported distribution. Against
    the reference: the server draws the token its own distribution ranks first far less often than speculation off
    does (temperature 1's flatter distribution: 37 % against 70 %), found by the two-sample test with the request as
    the unit (p near 1e-7 at this size; at 600 tokens, 5 requests a side, p was 3.6e-5 once and 0.0034 the next
    time). A server of its own: on the package's faulty one, rejection-reuse-uniform draws the residual's likeliest
    token at every rejection, which moves the share of first-ranked draws back up (p = 0.0044 there once)."""
    server = Server("--pp", "2", "--fault", "sampling-params-ignored", "--allow-unhealthy")
    try:
        sampling = ("--sampling", str(DEFAULT_SAMPLING_TOKENS), "--sampling-settings", "0.6:0.95")
        result = probe(server.url, *sampling, "--reference-url", servers["off"].url, "--json", "-")
    finally:
        server.stop()
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    errors = [f for f in json.loads(result.stdout)["findings"] if f["severity"] == "error"]
    assert {f["check"] for f in errors} == {"probe.sampling"} and all(f["hint"] for f in errors)
    assert any("parameters were not applied" in f["message"] for f in errors)
    two_sample = [f for f in errors if "without speculation" in f["message"]]
    assert len(two_sample) == 1 and two_sample[0]["data"]["two_sample_p_value"] < 0.001, result.stdout[-3000:]


def test_a_prefix_cache_that_loses_the_drafters_context_fails_the_prefix_cache_sweep():
    """DSpark reads its context through its own K/V, which the fault leaves as the reused blocks held them: warm
    prompts accept less than the same prompts cold (a fresh server: the blocks it reuses are the probe's own)."""
    server = Server("--model", "demo-dspark", "--fault", "prefix-cache-drafter-kv", "--allow-unhealthy")
    try:
        result = probe(server.url, "--prefix-cache", "--json", "-")
    finally:
        server.stop()
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    report = json.loads(result.stdout)
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    assert [f["check"] for f in errors] == ["probe.prefix-cache"] and errors[0]["data"]["from"] == "warm"
    summary = report["sweeps"][0]["summary"]
    assert "cached:" in summary and "not reported" not in summary
    # the first round sized the sweep, and the rounds after it joined its groups
    claim = rf"(\d+) prompts, power {POWER:g} to find a fall to {PREFIX_SIZED_FOR:.0%} of the cold rate"
    assert (sized := re.search(claim, summary)), summary
    sized = int(sized.group(1))
    assert PREFIX_ROUND < sized <= PREFIX_MAX_PROMPTS
    assert [point["requests"] for point in report["sweeps"][0]["points"]] == [sized, sized]


def test_prefix_caching_restores_blocks_without_changing_output(servers):
    """The healthy server (PP 2) caches a repeated prompt's whole blocks and answers it the same."""
    body = {"prompt": "def parse(text):\n" * 20, "max_tokens": 16, "temperature": 0}
    first, second = (httpx.post(f"{servers['healthy'].url}/v1/completions", json=body, timeout=60).json() for _ in "ab")
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (second["usage"]["prompt_tokens"] - 1) // 16 * 16 > 0


def test_a_sweep_that_cannot_run_fails_the_probe_and_says_why(servers, tmp_path):
    """Buckets the served context cannot hold, and a reference server that is not there: both not run, with the
    reason; the verdict is not verified, the exit code 1, and JUnit shows both as failures."""
    junit = tmp_path / "probe.xml"
    dead = f"http://127.0.0.1:{free_port()}"
    args = ("--context-sweep", "--context-lengths", "4000", "--reference-url", dead, "--junit-xml", str(junit))
    result = probe(servers["healthy"].url, *args, "--json", "-")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    sweeps = sweeps_of(result)
    assert [s["status"] for s in sweeps.values()] == ["not run", "not run"]
    assert "fewer than two prompt lengths" in sweeps["context"]["summary"]
    assert "cannot reach the server" in sweeps["reference"]["summary"]
    assert report["verdict"]["summary"].startswith("not verified: context: ")
    assert junit_cases(junit)["probe.context"] and junit_cases(junit)["probe.reference"]


def test_bad_sweep_flags_exit_2_in_one_line(servers):
    result = probe(servers["healthy"].url, "--concurrency", "1,four")
    assert result.returncode == 2 and result.stderr.strip() == (
        "specdoctor: error: --concurrency '1,four' is not a list of positive integers such as 1,4,16"
    )
    single = probe(servers["healthy"].url, "--concurrency", "4")
    assert single.returncode == 2 and "give two levels or more" in single.stderr
    for alpha in ("0", "0.6"):  # a rate no test can hold, or one past a coin's
        bad = probe(servers["healthy"].url, "--concurrency", "1,4", "--alpha", alpha)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--alpha" in bad.stderr
    fault = subprocess.run(
        [sys.executable, "-m", "specdoctor", "serve", "--model", "demo", "--fault", "stale-rows"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fault.returncode == 2 and "--fault: unknown fault 'stale-rows'" in fault.stderr
    assert len(fault.stderr.strip().splitlines()) == 1


def test_a_prompt_seed_sends_other_prompts_and_the_report_keeps_it_and_alpha(servers):
    """--prompt-seed moves the sweeps' prompts in the corpus (the same server, other counts); the report's settings
    say which prompts and which alpha decided it, so a run can be repeated, and the sweep's summary its alpha."""
    runs = {
        seed: probe(
            servers["healthy"].url, "--concurrency", "1,4", "--prompt-seed", seed, "--alpha", "0.05", "--json", "-"
        )
        for seed in ("0", "7")
    }
    reports = {seed: json.loads(run.stdout) for seed, run in runs.items() if run.returncode == 0}
    assert len(reports) == 2, [run.stdout[-2000:] + run.stderr for run in runs.values()]
    assert [reports[seed]["settings"]["sweeps"]["prompt_seed"] for seed in ("0", "7")] == [0, 7]
    assert reports["7"]["settings"]["sweeps"]["alpha"] == 0.05
    assert "variance, false-positive rate 0.05;" in reports["7"]["sweeps"][0]["summary"]
    counts = {seed: [p["metrics"] for p in report["sweeps"][0]["points"]] for seed, report in reports.items()}
    assert counts["0"] != counts["7"]


def test_corpus_prompts_move_with_the_seed_and_stay_paired_across_lengths():
    """Seed 0 keeps the places prompts always started at (STARTS lines spread over the corpus); a seed moves each
    share's places, so prompt i of every length still starts at one place (the context sweep pairs them). Indices
    past STARTS (the prefix-cache sweep's, up to PREFIX_MAX_PROMPTS) start elsewhere in their share, apart enough
    that its short prompts do not repeat one another, whatever the seed (in their share or the next)."""
    text = corpus_text()
    for index in (0, 17, STARTS - 1):
        place = text.find("\n", len(text) * index // STARTS) + 1
        assert corpus_prompt(index, 300) == text[place : place + 300]
        moved = corpus_prompt(index, 2000, seed=3)
        assert moved.startswith(corpus_prompt(index, 300, seed=3)) and not moved.startswith(text[place : place + 300])
        assert corpus_prompt(index, 300, seed=3) != corpus_prompt(index, 300, seed=4)
    share = len(text) / STARTS
    for seed in (0, 1, 3, 4):
        # where each starts: 3,000 characters are found once in the corpus (300 may be found several times; the
        # last share's wrap round its start)
        starts = [(text + text).index(corpus_prompt(i, 3000, seed)) for i in range(PREFIX_MAX_PROMPTS)]
        assert all(i % STARTS * share <= start <= (i % STARTS + 1) * share for i, start in enumerate(starts))
        # every two apart, across shares too: 0.146 x LAPS_SPAN of a share at least (900 characters), less a line
        apart = sorted(starts) + [min(starts) + len(text)]
        assert min(b - a for a, b in zip(apart, apart[1:], strict=False)) > 0.11 * share, seed


def test_context_buckets_double_up_to_what_the_served_length_holds():
    assert context_lengths(SweepOptions(), 2048, 32) == [128, 256, 512, 1024, 1612]
    assert context_lengths(SweepOptions(), 1335, 32) == [128, 256, 512, 1042]  # not 1,024 beside 1,042
    assert context_lengths(SweepOptions(context_lengths=(4000, 512)), 2048, 32) == [512]  # what fits, sorted


def simulated_steps(generator: torch.Generator, steps: int, biased: bool) -> tuple[list[list[float]], list[int]]:
    """Steps of 6 bins with random probabilities; outcomes drawn from them, or (biased) the second bin whenever
    a draw would have left the first: the recovered token as the reused-uniform fault picks it."""
    probabilities = torch.distributions.Dirichlet(torch.ones(6)).sample((steps,))
    outcomes = torch.multinomial(probabilities, 1, generator=generator).squeeze(1)
    if biased:
        outcomes = torch.where(outcomes == 0, outcomes, torch.ones_like(outcomes))
    return probabilities.tolist(), outcomes.tolist()


def test_the_calibration_test_keeps_its_false_positive_rate_and_sees_a_biased_resample():
    """Under the null (outcomes drawn from the stated probabilities, every step its own distribution) the
    p-value is uniform: 2,000 simulated probes of 200 tokens reject at 5 % about 5 % of the time."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    p_values = [calibration_p_value(*simulated_steps(generator, 200, False))[1] for _ in range(2000)]
    rejected = sum(p < 0.05 for p in p_values) / len(p_values)
    assert 0.035 < rejected < 0.065  # 5 % +- 3 binomial standard deviations (0.5 %)
    assert calibration_p_value(*simulated_steps(generator, 200, True))[1] < 1e-6


def test_the_reused_uniform_fault_recovers_the_residual_argmax():
    """With the acceptance uniform reused as every candidate's noise, the recovered token is no longer a draw
    from the residual max(p - q, 0) but its largest entry, every time."""
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 4, 50, generator=generator), -1)  # [B, k+1, V]
    drafts = p[:, :3].argmax(-1)  # greedy drafts: q is one-hot on each
    q = torch.nn.functional.one_hot(drafts, 50).float()
    uniform = torch.ones(64, 3) * 0.999  # every draft rejected unless p(draft) > 0.999
    _, emitted = verify_random(drafts, q, p, uniform, generator, reuse_uniform=True)
    residual_argmax = (p[:, 0] - q[:, 0]).clamp(min=0).argmax(-1)
    assert torch.equal(emitted[:, 0], residual_argmax)
    _, healthy = verify_random(drafts, q, p, uniform, generator)
    assert not torch.equal(healthy[:, 0], residual_argmax)


def reply(ids: list[int], tops: list[dict] | None = None) -> dict:
    logprobs = {"tokens": [f"token_id:{i}" for i in ids], "top_logprobs": tops or [{} for _ in ids]}
    return {"choices": [{"text": "", "logprobs": logprobs}]}


def test_a_divergence_at_a_near_tie_is_told_from_a_real_one():
    tied = [{"token_id:5": -0.69, "token_id:6": -0.70}, {"token_id:7": -0.01}]
    assert divergence(reply([5, 7]), reply([5, 7], tied)) is None
    assert divergence(reply([6, 1]), reply([5, 7], tied)) == {"index": 0, "gap": pytest.approx(0.01)}
    assert divergence(reply([5, 9]), reply([5, 7], tied))["gap"] == math.inf  # not among the reference's top 2
    assert divergence(reply([5]), reply([5, 7], tied)) == {"index": 1, "gap": math.inf}
