"""`--fault drafter-rope-past=N`: the drafter's positions from N on rotate as their remainder by N. A partial fall,
not dummy drafts: the battery stays lossless, acceptance falls but drafts are still accepted at every position;
past every position the battery reaches, nothing changes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.faults import Faults


def battery_metrics(tmp_path, fault: str) -> tuple[dict, str]:
    report = tmp_path / f"{fault}.json"
    command = [sys.executable, "-m", "specdoctor", "check", "--model", "demo-dspark", "--fault", fault]
    subprocess.run([*command, "--json", str(report)], capture_output=True, text=True, timeout=600)
    behaviour = json.loads(report.read_text())["stages"][0]["behaviour"]
    return behaviour["metrics"], behaviour["battery"]


@pytest.mark.timeout(900)
def test_a_drafter_whose_positions_wrap_accepts_less_and_stays_lossless(tmp_path):
    wrapped, battery = battery_metrics(tmp_path, "drafter-rope-past=8")
    beyond, _ = battery_metrics(tmp_path, "drafter-rope-past=4096")  # past the battery: the healthy drafter
    assert battery == "9/9"
    assert wrapped["mean_acceptance_length"] < 0.75 * beyond["mean_acceptance_length"]
    assert all(count > 0 for count in wrapped["num_accepted_tokens_per_pos"][:2])  # not dummy drafts


def test_the_fault_takes_a_positive_position():
    assert Faults.parse("drafter-rope-past=128").drafter_rope_past == 128
    with pytest.raises(SpecdoctorError, match="unknown fault 'drafter-rope-past=0' .*drafter-rope-past=N"):
        Faults.parse("drafter-rope-past=0")
