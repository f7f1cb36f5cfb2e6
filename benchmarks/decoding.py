"""Speculative against plain decoding in specdoctor's runtime on the demo model: tokens/s, mean
acceptance length, the speed-up's bound and each step's time split (target, draft, transfer, host), for
PP 1 and 4, k 1-5, eager and compiled (one after the other, in one run). The same measurement as
`specdoctor bench --model demo --pp 1 --pp 4 [--no-compile]`.

    python -m benchmarks.decoding [--pp 1 --pp 4] [--k 1 2 3 4 5] [--modes eager compiled] [--max-tokens 64]
        [--json FILE]
"""

from __future__ import annotations

import argparse

from rich.console import Console

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.commands.bench import bench_table
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.workflow.bench import BenchOptions, run_bench

MODES = {"eager": False, "compiled": True}
TARGET_OF_BOUND = 0.85


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, action="append", help="repeat; default 1 and 4")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["eager", "compiled"])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    add_json_option(parser, "decoding")
    args = parser.parse_args()
    console = Console(width=160)
    reports = {}
    for mode in args.modes:
        runtime = RuntimeOptions("demo", compile=MODES[mode])
        options = BenchOptions(runtime, args.pp or [1, 4], args.k, args.max_tokens, args.batch_size)
        reports[mode] = report = run_bench(options, show_progress=True)
        console.print(bench_table(report))
        for row in report["rows"]:
            if row["k"]:
                console.print(
                    f"{mode}, PP {row['pp']}, k {row['k']}: speed-up {row['speedup']:.2f}x, bound "
                    f"{row['speedup_bound']:.2f}x: {row['speedup_of_bound']:.2f} of it (target >= {TARGET_OF_BOUND})"
                )
    console.print(f"machine: {machine()}")
    write_json(args.json, {"modes": reports})


if __name__ == "__main__":
    main()
