"""`probe`'s sweeps on the demo: the false-positive rate on a healthy server, each fault found by its sweep,
the sampling test's power against the reused-uniform fault, and how long `probe --all` takes.

    python -m benchmarks.probe_sweeps [--healthy-runs 20] [--power-runs 10] [--json FILE]

`specdoctor serve --model demo` (PP 1, fp32, k 3), the probe as a user runs it (a process per run):
1. healthy: `probe --all --reference-url OFF` `--healthy-runs` times (OFF: the demo with speculation off); the
   share of runs that exit 0, per sweep, and the wall time of each run;
2. each fault on a server of its own (the demo; demo-dspark for the prefix cache), probed with its sweep: the
   exit code and the finding;
3. power: `probe --sampling N` against `--fault rejection-reuse-uniform`, `--power-runs` times per N: the share
   of runs that find it (p < 0.001), and against a healthy server the share that do (the false positives).
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.progress import track

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from tests.helpers.servers import SpecdoctorServer, probe

FAULT_SWEEPS = {  # fault: (demo, the sweep that finds it)
    "drafter-max-position=1024": ("demo", "--context-sweep"),
    "stale-batch-rows": ("demo", "--concurrency", "1,4,16"),
    "prefix-cache-drafter-kv": ("demo-dspark", "--prefix-cache"),  # a drafter that reads its context K/V
    "rejection-reuse-uniform": ("demo", "--sampling", "2000"),
}
POWER_TOKENS = (100, 200, 300, 500)


def probed(url: str, *args: str) -> tuple[int, dict, float]:
    """(exit code, JSON report, seconds) of one probe run."""
    started = time.perf_counter()
    result = probe(url, *args, "--json", "-")
    return result.returncode, json.loads(result.stdout), time.perf_counter() - started


def healthy_runs(runs: int) -> dict:
    healthy, off = SpecdoctorServer(), SpecdoctorServer("--num-speculative-tokens", "0")
    try:
        results = [probed(healthy.url, "--all", "--reference-url", off.url) for _ in track(range(runs), "healthy")]
    finally:
        healthy.stop()
        off.stop()
    statuses = {}
    for _, report, _ in results:
        for sweep in report["sweeps"]:
            statuses.setdefault(sweep["name"], []).append(sweep["status"])
    context = next(sweep for sweep in results[0][1]["sweeps"] if sweep["name"] == "context")
    return {
        "runs": runs,
        "exit_0": sum(code == 0 for code, _, _ in results),
        "context_points": [(p["label"], p["metrics"]["per_position_acceptance_rate"][0]) for p in context["points"]],
        "passed_per_sweep": {name: seen.count("passed") for name, seen in statuses.items()},
        "seconds": [round(seconds, 1) for _, _, seconds in results],
    }


def fault_runs() -> dict:
    found = {}
    for fault, (demo, *args) in FAULT_SWEEPS.items():
        server = SpecdoctorServer("--fault", fault, "--allow-unhealthy", model=demo)
        try:
            code, report, seconds = probed(server.url, *args)
        finally:
            server.stop()
        errors = [f["message"] for f in report["findings"] if f["severity"] == "error"]
        found[fault] = {"exit": code, "finding": errors[0] if errors else None, "seconds": round(seconds, 1)}
    return found


def power_runs(runs: int) -> dict:
    faulty = SpecdoctorServer("--fault", "rejection-reuse-uniform", "--allow-unhealthy")
    healthy = SpecdoctorServer()
    power = {}
    try:
        for tokens in track(POWER_TOKENS, "power"):
            row = {}
            for name, server in (("faulty", faulty), ("healthy", healthy)):
                reports = [probed(server.url, "--sampling", str(tokens))[1] for _ in range(runs)]
                row[name] = sum(r["sweeps"][0]["status"] == "failed" for r in reports) / runs
            power[tokens] = row
    finally:
        faulty.stop()
        healthy.stop()
    return power


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--healthy-runs", type=int, default=20)
    parser.add_argument("--power-runs", type=int, default=10)
    add_json_option(parser, "probe_sweeps")
    args = parser.parse_args()
    console = Console()
    results = {"machine": machine(), "faults": fault_runs(), "power": power_runs(args.power_runs)}
    results["healthy"] = healthy_runs(args.healthy_runs)
    healthy = results["healthy"]
    console.print(
        f"healthy: {healthy['exit_0']}/{healthy['runs']} runs exit 0; passed per sweep {healthy['passed_per_sweep']}; "
        f"probe --all {min(healthy['seconds'])}-{max(healthy['seconds'])} s"
    )
    console.print(
        "context, position 0: " + ", ".join(f"{rate:.0%} at {label}" for label, rate in healthy["context_points"])
    )
    for fault, outcome in results["faults"].items():
        console.print(f"{fault}: exit {outcome['exit']} in {outcome['seconds']} s: {outcome['finding']}")
    table = numeric_table("sampling sweep: share of runs failing (p < 0.001)", ("tokens", "faulty", "healthy"))
    for tokens, row in results["power"].items():
        table.add_row(str(tokens), f"{row['faulty']:.0%}", f"{row['healthy']:.0%}")
    console.print(table)
    console.print(f"machine: {results['machine']}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
