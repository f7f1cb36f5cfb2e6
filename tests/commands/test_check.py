"""`specdoctor check` from the command line: exit codes, JSON, JUnit and HTML reports, the checkpoint never
written, and bad input in one line (the workflow's findings: tests/workflow/test_check.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from specdoctor.runtime.checkpoint.files import DEMO_DIR
from tests.helpers.browser import images_loaded

CUDA_DEVICES = torch.cuda.device_count()
CUDA_REFUSAL = "ranks on this machine need as many CUDA devices" if CUDA_DEVICES else "this machine has no CUDA device"


def specdoctor(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = os.environ | {"COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "specdoctor", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def test_cli_broken_drafter_exits_1_with_json_and_junit(tmp_path):
    junit = tmp_path / "report.xml"
    result = specdoctor("check", "--model", "demo", "--pp", "2", "--json", "-", "--junit-xml", str(junit))
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)  # --json - prints only JSON
    assert report["schema"] == "specdoctor.check/1"
    assert report["verdict"] == {"healthy": False, "exit_code": 1, "summary": report["verdict"]["summary"]}
    assert report["comparison"][0]["battery"] == "9/9"
    assert report["placement"][1]["has_drafter"] and not report["placement"][1]["has_embedding"]
    suite = ET.parse(junit).getroot()
    failed = {case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None}
    assert {"drafter.provenance", "behaviour.acceptance"} <= failed
    assert int(suite.get("failures")) == len(failed)


def test_cli_repair_prints_before_after_and_exits_0(tmp_path):
    out, html = tmp_path / "report.json", tmp_path / "report.html"
    result = specdoctor("check", "--model", "demo", "--pp", "2", "--repair", "--json", str(out), "--html", str(html))
    assert result.returncode == 0, result.stderr
    assert "Before / after" in result.stdout and "healthy after repair" in result.stdout
    report = json.loads(out.read_text())
    assert [row["stage"] for row in report["comparison"]] == ["before", "after"]
    # Whatever the uninitialised memory held, it is not the checkpoint's embedding; after the repair it is.
    before, after = report["stages"]
    assert "drafter.fingerprint" in before["signals"]["content"]
    assert after["signals"] == {"content": [], "behaviour": []}
    assert after["drafter"]["tensors"]["embed_tokens.weight"]["mismatched_rows"] == 0
    # The HTML report opens in a real browser, its before/after chart loaded.
    assert images_loaded(html, tmp_path / "profile") == (1, 1) and "healthy after repair" in html.read_text()


def test_repair_never_writes_to_the_checkpoint(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(DEMO_DIR, path)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in path.iterdir()}
    result = specdoctor("repair", "--model", str(path), "--pp", "2", "--json", "-")
    assert result.returncode == 0, result.stderr
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in path.iterdir()} == before


@pytest.mark.parametrize(
    "args, message",
    [
        (("--pp", "0"), "--pp must be at least 1"),
        (("--num-speculative-tokens", "0"), "must be in 1..8"),
        (("--drafter-policy", "bogus"), "Invalid value for '--drafter-policy'"),
        (("--battery", "/nonexistent/battery.jsonl"), "cannot read battery"),
        (("--tensor-parallel-size", "3", "--repair"), "--tensor-parallel-size 3: 2 KV heads neither divide over"),
        (("--tp", "4"), "Total number of attention heads (6) must be divisible by tensor parallel size (4)"),
        (("--tp", "2", "--model", "demo-w4a16"), "input values of 192 are not whole multiples of 64"),
        # NCCL runs one rank per GPU: one rank more than this machine's GPUs (on CI, --device cuda itself)
        (("--device", "cuda", "--pp", str(CUDA_DEVICES + 1)), CUDA_REFUSAL),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    result = specdoctor("check", "--model", "demo", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
