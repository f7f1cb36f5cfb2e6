"""Speculative against plain decoding in specdoctor's runtime on the demo model: tokens/s, mean
acceptance length and each step's time split (target, draft, transfer, host), for PP 1 and 4, k 1-5.
The same measurement as `specdoctor bench --model demo --pp 1 --pp 4`.

    python -m benchmarks.decoding [--pp 1 --pp 4] [--max-tokens 64] [--json runs/decoding.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from benchmarks.common import machine, write_json
from specdoctor.commands.bench import BenchOptions, bench_table, run_bench
from specdoctor.runtime.options import RuntimeOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, action="append", help="repeat; default 1 and 4")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("runs/decoding.json"))
    args = parser.parse_args()
    options = BenchOptions(RuntimeOptions("demo"), args.pp or [1, 4], [1, 2, 3, 4, 5], args.max_tokens, args.batch_size)
    report = run_bench(options, show_progress=True)
    console = Console(width=160)
    console.print(bench_table(report))
    for row in report["rows"]:
        if row["pp"] == 1 and row["k"] == 3:
            ratio = row["speedup_per_acceptance_length"]
            console.print(
                f"PP 1, k 3: speed-up {row['speedup']:.2f}x = {ratio:.2f} x mean acceptance length (target >= 0.75)"
            )
    console.print(f"machine: {machine()}")
    write_json(args.json, report)


if __name__ == "__main__":
    main()
