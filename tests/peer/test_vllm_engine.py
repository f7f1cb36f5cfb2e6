"""`check --engine vllm` inside vLLM's own workers (the CPU build, its own loading), run as a user runs it: the
specdoctor installed in vLLM's environment, its plugin registered there. A healthy drafter is healthy; a failure
engines have shipped, made in the live worker, is named with its tensor and worker and leaves vLLM's output right
while its acceptance falls; `--repair` repairs it inside the workers, after which vLLM's own per-prompt counters
equal the healthy run's, prompt for prompt. TP 1 runs in process (vLLM's uni executor), TP 2 as users run it
(a process per worker)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from specdoctor.engines.vllm import FAULT
from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS

pytestmark = [pytest.mark.timeout(900), pytest.mark.tool_env("vllm")]

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
VLLM_FLAGS = ["--max-model-len", "256"]
UNI = ["--distributed-executor-backend", "uni"]
TP2_BOUND = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per worker


def check_in_vllm(vllm_python, tmp_path, model: list[str], *flags: str, fault=None, env=IN_PROCESS, extra=UNI):
    """`specdoctor check --engine vllm` from vLLM's own Python: its exit code and JSON report."""
    tmp_path.mkdir(exist_ok=True)
    report = tmp_path / "report.json"
    command = [str(vllm_python), "-m", "specdoctor", "check", "--engine", "vllm", *model, "--json", str(report)]
    environment = os.environ | env | ({FAULT: fault} if fault else {})
    command += [*flags, *VLLM_FLAGS, *extra]
    result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=800)
    assert report.is_file(), result.stderr[-3000:]
    return result.returncode, json.loads(report.read_text())


def tables(report: dict, stage: int = 0) -> dict[tuple[str, str], dict]:
    """(tensor, worker label) -> the drafter table's finding in that stage."""
    return {
        (f["data"]["tensor"], f["data"]["worker"]["label"]): f
        for f in report["stages"][stage]["findings"]
        if f["check"] == "drafter.fingerprint"
    }


def per_prompt(report: dict, stage: int) -> list[dict]:
    return report["stages"][stage]["behaviour"]["per_prompt"]


MTP = ["--model", "demo"]
EAGLE3 = ["--model", "demo-dspark", "--speculative-model", str(DEMO_DRAFTERS["demo-eagle3"])]


@pytest.fixture(scope="module")
def healthy_run(vllm_python, tmp_path_factory):
    """The healthy run of a pair, made once per module for every test that compares with it."""
    runs = {}

    def run(model: list[str]):
        key = " ".join(model)
        if key not in runs:
            runs[key] = check_in_vllm(vllm_python, tmp_path_factory.mktemp("healthy"), model)
        return runs[key]

    return run


@pytest.fixture(scope="module")
def healthy_mtp(healthy_run):
    return healthy_run(MTP)


def test_a_healthy_mtp_drafter_in_vllms_worker_is_healthy(healthy_mtp):
    code, report = healthy_mtp
    assert code == 0, report["verdict"]
    assert report["verdict"]["summary"] == "healthy"
    assert report["settings"]["engine"] == "vllm" and report["settings"]["vllm"].startswith("0.32")
    found = tables(report)
    # vLLM 0.32 at PP 1: the MTP layer's embedding and head are the target's own modules, holding its rows
    assert set(found) == {
        ("embed_tokens.weight", "TP 0/1, PP 0/1"),
        ("layers.4.shared_head.head.weight", "TP 0/1, PP 0/1"),
    }
    assert all(f["severity"] == "info" and f["data"]["shared_with_target"] for f in found.values())
    assert report["stages"][0]["behaviour"]["battery"] == "9/9"  # vLLM with speculation off as the reference
    assert sum(p["num_accepted_tokens"] for p in per_prompt(report, 0)) > 0


def test_the_seeds_failure_in_vllms_worker_is_named_and_fails_the_check(vllm_python, tmp_path, healthy_mtp):
    code, report = check_in_vllm(vllm_python, tmp_path, MTP, fault="embedding-uninitialised")
    assert code == 1
    embedding = tables(report)["embed_tokens.weight", "TP 0/1, PP 0/1"]
    assert embedding["severity"] == "error"
    assert embedding["message"] == (
        "embed_tokens.weight on vLLM worker TP 0/1, PP 0/1: rows 0..2048 do not hold model.embed_tokens.weight's rows"
    )
    assert tables(report)["layers.4.shared_head.head.weight", "TP 0/1, PP 0/1"]["severity"] == "info"
    # the silent failure in the real engine: vLLM's output stays right, its acceptance falls
    stage = report["stages"][0]
    assert stage["behaviour"]["battery"] == "9/9"
    _, healthy = healthy_mtp
    accepted = [sum(p["num_accepted_tokens"] for p in per_prompt(r, 0)) for r in (report, healthy)]
    assert accepted[0] < accepted[1] / 2
    assert "behaviour.acceptance" in stage["signals"]["behaviour"]


@pytest.mark.parametrize(
    "model, fault",
    [(MTP, "embedding-zeroed"), (EAGLE3, "embedding-zeroed")],
    ids=["mtp", "eagle3"],
)
def test_the_repair_in_vllms_workers_gives_back_the_healthy_counters(vllm_python, tmp_path, healthy_run, model, fault):
    """One start with the fault and --repair (the before stage is the broken drafter), against one healthy start:
    after the repair inside the worker, vLLM's per-prompt counters equal the healthy run's, prompt for prompt."""
    healthy_code, healthy = healthy_run(model)
    assert healthy_code == 0, healthy["verdict"]
    code, report = check_in_vllm(vllm_python, tmp_path, model, "--repair", fault=fault)
    assert code == 0, report["verdict"]
    assert report["verdict"]["summary"] == "healthy after repair"
    assert tables(report, 0)["embed_tokens.weight", "TP 0/1, PP 0/1"]["severity"] == "error"
    assert all(f["severity"] == "info" for f in tables(report, 1).values())
    assert report["repair"]["repaired"] == {"TP 0/1, PP 0/1": {"embed_tokens.weight": "model.embed_tokens.weight"}}
    assert report["repair"]["bytes_read"] > 0
    assert per_prompt(report, 1) == per_prompt(healthy, 0)
    assert per_prompt(report, 0) != per_prompt(healthy, 0)


def test_a_draft_model_pair_in_vllm_is_healthy_and_repaired(vllm_python, tmp_path, demo_draft_model):
    """The target's first two layers as its draft model accept 1.31 tokens a step in vLLM: the bar is set below."""
    model = ["--model", "demo-dspark", "--speculative-model", str(demo_draft_model), "--min-acceptance-length", "1.2"]
    healthy_code, healthy = check_in_vllm(vllm_python, tmp_path / "healthy", model)
    assert healthy_code == 0, healthy["verdict"]
    code, report = check_in_vllm(vllm_python, tmp_path / "repaired", model, "--repair", fault="embedding-zeroed")
    assert code == 0, report["verdict"]
    # a draft model is a whole model of its own: its tensors keep the target loader's names
    assert tables(report, 0)["model.embed_tokens.weight", "TP 0/1, PP 0/1"]["severity"] == "error"
    assert all(f["severity"] == "info" for f in tables(report, 1).values())
    assert per_prompt(report, 1) == per_prompt(healthy, 0)


def test_a_shifted_vocabulary_shard_on_tp_rank_1_is_named_and_repaired(vllm_python, tmp_path, healthy_mtp):
    """TP 2, a process per worker: the shard of TP rank 1 holds the rows one off, rank 0's is right. A partial
    failure: acceptance falls by a seventh, not to 1. After the repair, vLLM's per-prompt counters are the healthy
    TP 1 run's (for this pair and battery TP 2's other rounding of the partial sums changes no greedy token)."""
    code, report = check_in_vllm(
        vllm_python, tmp_path, [*MTP, "--tp", "2"], "--repair", fault="vocab-shard-shifted", env=TP2_BOUND, extra=[]
    )
    assert code == 0, report["verdict"]
    before = tables(report, 0)
    assert before["embed_tokens.weight", "TP 1/2, PP 0/1"]["severity"] == "error"
    assert before["embed_tokens.weight", "TP 1/2, PP 0/1"]["data"]["rows"] == [1024, 2048]
    assert before["embed_tokens.weight", "TP 0/2, PP 0/1"]["severity"] == "info"
    assert all(f["severity"] == "info" for f in tables(report, 1).values())
    assert report["repair"]["repaired"] == {"TP 1/2, PP 0/1": {"embed_tokens.weight": "model.embed_tokens.weight"}}
    rates = [report["comparison"][stage]["mean_acceptance_length"] for stage in (0, 1)]
    assert rates[0] < rates[1]
    assert per_prompt(report, 1) == per_prompt(healthy_mtp[1], 0)


def test_vllms_refusal_of_a_flag_is_one_line_and_exit_2(vllm_python, tmp_path):
    command = [str(vllm_python), "-m", "specdoctor", "check", "--engine", "vllm", "--model", "demo"]
    result = subprocess.run([*command, "--no-such-vllm-flag", "3"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "unrecognized arguments: --no-such-vllm-flag 3" in result.stderr


def test_a_vllm_that_does_not_finish_in_time_is_exit_2_naming_the_limit(vllm_python, tmp_path):
    command = [str(vllm_python), "-m", "specdoctor", "check", "--engine", "vllm", "--model", "demo"]
    result = subprocess.run([*command, "--engine-timeout", "3"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "vLLM did not finish within 3 s (--engine-timeout)" in result.stderr


def test_at_pp_2_vllms_own_loading_is_examined_on_every_worker_before_the_cpu_build_stops(vllm_python, tmp_path):
    """vLLM 0.32's CPU build cannot run a drafter at PP 2 (docs/vllm-plugin.md: it dies allocating its KV cache),
    but its workers examine the drafter as they load: the report still has every worker, and exit 2 names where
    vLLM stopped. An EAGLE-3 head without an embedding of its own, under vLLM's own loading and no injected fault:
    the embedding of the drafter on the last rank does not hold the target's rows, the seed's failure as the real
    engine makes it; the head, shared with the target there, does."""
    code, report = check_in_vllm(vllm_python, tmp_path, [*EAGLE3, "--pp", "2"], env=TP2_BOUND, extra=[])
    assert code == 2
    assert "'CPUModelRunner' object has no attribute 'drafter'" in report["error"]["message"]
    found = tables(report)
    assert found["embed_tokens.weight", "TP 0/1, PP 1/2"]["severity"] == "error"
    assert found["lm_head.weight", "TP 0/1, PP 1/2"]["severity"] == "info"
    first = [f for f in report["stages"][0]["findings"] if f["check"] == "engine.worker"]
    assert [f["message"] for f in first] == ["vLLM worker TP 0/1, PP 0/2 holds no drafter"]
