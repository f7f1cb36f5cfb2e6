"""`--engine vllm`'s refusals before any vLLM starts, run as a real process from this Python (which has no vLLM):
each one line, exit 2, no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


def check(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "specdoctor", "check", "--model", "demo", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--engine", "vllm"], f"--engine vllm: vLLM is not installed in this Python ({sys.executable})"),
        (
            ["--max-model-len", "256"],
            "no such option: --max-model-len (options of vLLM's go through",
        ),
        (
            ["--engine", "vllm", "--fill", "zeros"],
            "--fill is a flag of specdoctor's own runtime",
        ),
        (["--engine", "vllm", "--memory-limit", "8GiB"], "--memory-limit plans specdoctor's own ranks"),
        (["--engine", "vllm", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be in 1..8, got 0"),
    ],
    ids=["vllm-missing", "vllm-flag-without-engine", "runtime-only-flag", "memory-limit", "no-drafts"],
)
def test_engine_refusals_are_one_line_and_exit_2(args, message):
    result = check(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
