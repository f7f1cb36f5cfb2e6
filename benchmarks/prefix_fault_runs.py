"""The prefix-cache sweep against fresh servers, run after run: how often it finds `prefix-cache-drafter-kv`
(or, with --healthy, how often it passes a healthy server). Each run starts its own server, so the blocks the fault
restores are the probe's own, and each probe's prompts carry a new random first line: the variation that
resampling one run's requests (benchmarks/probe_rates.py) cannot show.

    python -m benchmarks.prefix_fault_runs [--runs 6] [--healthy] [--json FILE]

`specdoctor serve --model demo-dspark` (eager, k 4), then `probe --prefix-cache`: each run's exit code, summary and
error finding.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from benchmarks.common import add_json_option, write_json
from tests.helpers.servers import SpecdoctorServer, probe


def one_run(healthy: bool) -> dict:
    args = ("--num-speculative-tokens", "4") if healthy else ("--fault", "prefix-cache-drafter-kv", "--allow-unhealthy")
    server = SpecdoctorServer("--model", "demo-dspark", *args)
    try:
        result = probe(server.url, "--prefix-cache", "--json", "-")
    finally:
        server.stop()
    report = json.loads(result.stdout)
    errors = [f["message"] for f in report["findings"] if f["severity"] == "error"]
    return {"exit_code": result.returncode, "summary": report["sweeps"][0]["summary"], "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--healthy", action="store_true", help="a healthy server instead of the faulty one")
    add_json_option(parser, "prefix_fault_runs")
    args = parser.parse_args()
    console, runs = Console(), []
    for index in range(args.runs):
        runs.append(one_run(args.healthy))
        console.print(f"run {index + 1}: exit {runs[-1]['exit_code']}, {runs[-1]['summary']}", *runs[-1]["errors"])
    failed = sum(run["exit_code"] == 1 for run in runs)
    console.print(f"the sweep failed {failed} of {args.runs} runs")
    write_json(args.json, {"healthy": args.healthy, "failed": failed, "runs": runs})


if __name__ == "__main__":
    main()
