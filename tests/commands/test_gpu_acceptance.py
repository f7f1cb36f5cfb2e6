"""`benchmarks/gpu_acceptance.sh`, the one command for real GPUs: without one it says so and exits 2; with
`--device cpu` the same path runs on the CPU and writes the JSON a GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu_acceptance.sh"


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    out = tmp_path / "gpu.json"
    result = run_script("--json", str(out))
    assert result.returncode == 2, result.stderr
    assert result.stdout.count("\n") == 1 and "no CUDA GPU" in result.stdout and not result.stderr
    assert not out.exists()


def test_on_the_cpu_it_checks_every_pp_size_against_plain_and_the_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    result = run_script(
        "--device", "cpu", "--demos", "demo", "--pp", "1", "2", "--max-tokens", "16", "--json", str(out)
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["kernels"] == "torch"
    rows = report["rows"]
    assert [(row["model"], row["pp"], row["k"]) for row in rows] == [("demo", 1, 3), ("demo", 2, 3)]
    for row in rows:
        assert row["lossless"] and row["plain_matches_cpu"] and row["drafter_tensors_measured"] > 0
        rates = row["acceptance_per_position"]
        assert len(rates) == 3 and all(0 <= rate <= 1 for rate in rates) and rates[0] > 0.5
        # vLLM's two counters agree: the mean length is 1 (the bonus token) plus the per-position rates.
        assert row["mean_acceptance_length"] == pytest.approx(1 + sum(rates))
        assert row["speculative_tokens_per_s"] > 0 and row["plain_tokens_per_s"] > 0
    # PP 2 accepts exactly what PP 1 accepts: the same greedy drafts on the same text.
    assert rows[0]["acceptance_per_position"] == rows[1]["acceptance_per_position"]


def test_in_bf16_a_difference_carries_its_evidence_and_only_ties_pass(tmp_path):
    """The deployment dtype: whatever this machine's bf16 rounding gives, a row differs exactly where it has
    evidence, and the script exits 1 only for a difference beyond rounding (bench's and check's rule)."""
    out = tmp_path / "gpu.json"
    result = run_script("--device", "cpu", "--demos", "demo", "--pp", "1", "--dtype", "bfloat16", "--json", str(out))
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and "Traceback" not in result.stderr
    (row,) = report["rows"]
    assert row["lossless"] == (row["divergences"] == [])
    beyond = [d for d in row["divergences"] if not (d["gap"] is not None and d["gap"] <= d["tolerance"])]
    assert result.returncode == (1 if beyond else 0), result.stderr
    assert ("yes" if row["lossless"] else "NO" if beyond else "ties") in result.stdout
