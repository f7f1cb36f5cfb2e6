"""Time to verdict: `specdoctor check --model demo --pp 4 --repair` as a user runs it, process
start-up included, stage by stage, with the before/after table it reports.

    python -m benchmarks.check_demo [--model demo|demo-mla|demo-hybrid|demo-dspark|demo-eagle3] [--pp 4] [--k K]
        [--json FILE]

--k defaults to check's own default: 3, a block drafter's block size, or an EAGLE-3 head's proposal length.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.runtime.checkpoint.files import DEMO_MODELS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(DEMO_MODELS), default="demo")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--k", type=int, help="--num-speculative-tokens (check's default when not given)")
    add_json_option(parser, "check_demo")
    args = parser.parse_args()
    command = [
        sys.executable,
        "-m",
        "specdoctor",
        "check",
        "--model",
        args.model,
        "--pp",
        str(args.pp),
        *(["--num-speculative-tokens", str(args.k)] if args.k else []),
        "--repair",
        "--json",
        "-",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    report = json.loads(result.stdout)
    console = Console()
    command_line = f"specdoctor check --model {args.model} --pp {args.pp} --repair"
    timings = Table(title=f"{command_line}: {wall:.1f} s wall, exit {result.returncode}")
    timings.add_column("stage")
    timings.add_column("seconds", justify="right")
    inside = sum(report["timings"].values())
    timings.add_row("python start-up, imports, pre-flight", f"{wall - inside:.2f}")
    for stage, seconds in report["timings"].items():
        timings.add_row(stage, f"{seconds:.2f}")
    console.print(timings)
    comparison = Table(title="Before / after (mean acceptance length counts the bonus token)")
    for column in ("stage", "policy", "mean acceptance length", "acceptance rate", "per-position rates", "battery"):
        comparison.add_column(column)
    for row in report["comparison"]:
        comparison.add_row(
            row["stage"],
            row["policy"],
            f"{row['mean_acceptance_length']:.2f}",
            f"{row['acceptance_rate']:.1%}",
            " ".join(f"{r:.0%}" for r in row["per_position_acceptance_rate"]),
            row["battery"],
        )
    console.print(comparison)
    repair = report["repair"]
    console.print(
        f"repair: {repair['bytes_read']:,} bytes read in {repair['seconds'] * 1000:.1f} ms; "
        f"verdict: {report['verdict']['summary']}; machine: {machine()}"
    )
    write_json(
        args.json,
        {
            "wall_s": wall,
            "exit_code": result.returncode,
            "timings": report["timings"],
            "comparison": report["comparison"],
            "repair": repair,
        },
    )


if __name__ == "__main__":
    main()
