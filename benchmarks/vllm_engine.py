"""`specdoctor check --engine vllm --repair` inside vLLM 0.32's CPU build, as a user runs it (from vLLM's own
Python), for each pair and each fault made in the live worker: what the workers' tables showed, the acceptance
before and after the repair on the real engine, the bytes the repair read, and the wall time of the check.

    python -m benchmarks.vllm_engine [--json FILE]

TP 1 runs use vLLM's in-process executor; TP 2 a process per worker, one core each. vLLM's peer environment is
installed on first use (tests/peer/vllm_env.py), with specdoctor in it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console

from benchmarks.common import add_json_option, numeric_table, write_json
from specdoctor.engines.vllm import FAULT
from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS
from tests.peer.vllm_env import ensure_vllm

IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
TP2 = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
UNI = ["--distributed-executor-backend", "uni"]
EAGLE3 = ["--model", "demo-dspark", "--speculative-model", str(DEMO_DRAFTERS["demo-eagle3"])]
CASES = [  # (pair, flags, fault, environment)
    ("demo (MTP)", ["--model", "demo", *UNI], None, IN_PROCESS),
    ("demo (MTP)", ["--model", "demo", *UNI], "embedding-zeroed", IN_PROCESS),
    ("demo (MTP)", ["--model", "demo", *UNI], "embedding-uninitialised", IN_PROCESS),
    ("demo (MTP), TP 2", ["--model", "demo", "--tp", "2"], "vocab-shard-shifted", TP2),
    ("demo-eagle3", [*EAGLE3, *UNI], None, IN_PROCESS),
    ("demo-eagle3", [*EAGLE3, *UNI], "embedding-zeroed", IN_PROCESS),
]


def run(python: Path, flags: list[str], fault: str | None, env: dict) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as directory:
        report = Path(directory) / "report.json"
        command = [str(python), "-m", "specdoctor", "check", "--engine", "vllm", *flags, "--repair"]
        command += ["--max-model-len", "256", "--json", str(report)]
        environment = os.environ | env | ({FAULT: fault} if fault else {})
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
        return json.loads(report.read_text()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_json_option(parser, "vllm_engine")
    args = parser.parse_args()
    python = ensure_vllm()
    columns = ("pair", "fault", "wrong tables", "before", "after", "bytes read", "verdict", "check s")
    table = numeric_table("check --engine vllm --repair (vLLM 0.32 CPU, fp32, k 3, 9 prompts × 32 tokens)", columns)
    rows = []
    for pair, flags, fault, env in CASES:
        report, seconds = run(python, flags, fault, env)
        wrong = [
            f"{f['data']['tensor']} @ {f['data']['worker']['label']}"
            for f in report["stages"][0]["findings"]
            if f["check"] == "drafter.fingerprint" and f["severity"] == "error"
        ]
        before, after = (row["mean_acceptance_length"] for row in report["comparison"])
        row = {
            "pair": pair,
            "fault": fault,
            "wrong_tables": wrong,
            "mean_acceptance_length": {"before": before, "after": after},
            "bytes_read": report["repair"]["bytes_read"],
            "verdict": report["verdict"]["summary"],
            "exit_code": report["verdict"]["exit_code"],
            "seconds": round(seconds, 1),
        }
        rows.append(row)
        cells = [pair, fault or "none", "; ".join(wrong) or "none", f"{before:.2f}", f"{after:.2f}"]
        table.add_row(*cells, f"{row['bytes_read']:,}", row["verdict"], f"{seconds:.1f}")
    Console().print(table)
    write_json(args.json, {"vllm": report["settings"]["vllm"], "rows": rows})


if __name__ == "__main__":
    main()
