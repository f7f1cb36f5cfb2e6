"""The demo's MoE layer run each way the runtime could run it, compiled, side by side in one run: every expert
over every token (the runtime's path past the gathered-expert limit), gathered experts (copies of the picked
experts' weights, one batched matmul: the runtime's path up to the limit) and a grouped GEMM over the tokens
sorted by expert (`torch._grouped_mm`, reading each expert's weights in place: the runtime's path from the size
a CPU rank measured it faster at, when it loads). Microseconds a call for each number of tokens a pass routes (a
16-row k 3 verify pass routes 64); with --eager, each path as `--no-compile` runs it.

    python -m benchmarks.moe_paths [--tokens 4 16 28 36 64 128 256] [--rounds 5] [--eager] [--json FILE]

`torch._grouped_mm` runs float32 on the CPU in eager mode, but its shape function refuses anything but
bfloat16 under torch.compile, so the runtime wraps it as an opaque op of its own (`specdoctor::grouped_mm`).
Run with OMP_NUM_THREADS=1 for what one compute thread (a `serve` rank on two cores) sees.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.progress import Progress

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from specdoctor.runtime.models.moe import MoE
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import load_rank


def microseconds(function, args, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        function(*args)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4, 16, 28, 36, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5, help="the paths alternate; the median is kept")
    parser.add_argument("--calls", type=int, default=50, help="calls per path and round")
    parser.add_argument("--eager", action="store_true", help="time the paths uncompiled")
    add_json_option(parser, "moe_paths")
    args = parser.parse_args()
    model, _ = load_rank(RuntimeOptions("demo"), 0)
    layer = next(module for module in model.drafter.modules() if isinstance(module, MoE))
    mode = "eager" if args.eager else "compiled"
    compiled = (lambda path: path) if args.eager else (lambda path: torch.compile(path, dynamic=True, fullgraph=True))
    paths = {
        "every expert": compiled(layer.every_expert),
        "gathered": compiled(layer.gathered_experts),
        "grouped GEMM": compiled(layer.grouped_experts),
    }
    rows = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("compiling and measuring", total=len(args.tokens) * args.rounds * len(paths))
        for tokens in args.tokens:
            flat = torch.randn(tokens, layer.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens))
            routing = (flat, *layer.gate(flat))
            expected = layer.every_expert(*routing)
            for path in paths.values():  # each path gives every expert's sum (and compiles before it is timed)
                torch.testing.assert_close(path(*routing), expected, rtol=1e-4, atol=1e-5)
            samples = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, path in paths.items():
                    samples[name].append(microseconds(path, routing, args.calls))
                    progress.advance(task)
            rows.append({"tokens": tokens, **{name: statistics.median(times) for name, times in samples.items()}})
    table = numeric_table(
        f"the demo's MoE layer, µs a call ({mode}, float32, median of {args.rounds} rounds)", ("tokens", *paths)
    )
    for row in rows:
        table.add_row(str(row["tokens"]), *(f"{row[name]:.0f}" for name in paths))
    console = Console(width=120)
    console.print(table)
    console.print(f"gathered-expert limit: {layer.gathered_token_limit()} tokens; machine: {machine()}")
    write_json(args.json, {"mode": mode, "rows": rows})


if __name__ == "__main__":
    main()
