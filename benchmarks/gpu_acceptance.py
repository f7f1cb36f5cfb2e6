"""On a machine with CUDA GPUs, one command: every demo at PP 1, 2 and 4 on the GPUs (NCCL between ranks; the
Triton kernels wherever specdoctor dispatches to them: the drafter's content checks), each run's speculative
output checked against plain greedy output on the same device and against the CPU's, with acceptance per draft
position and tokens/s per PP size, as JSON.

    bash benchmarks/gpu_acceptance.sh [--device cuda] [--demos demo demo-mla ...] [--pp 1 2 4] [--max-tokens 64]
        [--dtype float32|bfloat16|float16] [--json FILE]

Without a CUDA GPU it says so in one line and exits 2. `--device cpu` runs the same path on the CPU (CI runs
it on one demo). A speculative output that differs from plain output on its device is weighed as `bench` and
`check` weigh it: lossless `ties` where every difference begins within rounding (bf16 and fp16 round a near tie
differently in a verify pass and a one-token step), `NO` otherwise; exit 1 on any `NO`. The 9 battery prompts
decode together (batch 9), after a short warm-up run.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from rich.console import Console

from benchmarks.common import add_json_option, numeric_table, write_json
from specdoctor.battery import battery_prompts
from specdoctor.checks.behaviour import divergence_evidence
from specdoctor.commands.bench import lossless_label
from specdoctor.kernels import backend
from specdoctor.runtime.checkpoint.files import DEMO_MODELS
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import load_codec
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import Dtype, RuntimeOptions

NO_GPU_EXIT = 2


def demo_prompts(demo: str) -> list[list[int]]:
    checkpoint = Checkpoint(demo)
    return battery_prompts(None, checkpoint, load_codec(checkpoint, None))[0]


def decode(options: RuntimeOptions, prompts: list[list[int]], max_tokens: int, plain_only: bool = False) -> dict:
    """Plain and speculative greedy decoding of the prompts on one engine: tokens, tokens/s, acceptance and where
    the two outputs differ (with `plain_only`, the plain run alone: the CPU reference)."""
    with Engine(options) as engine:
        engine.generate(prompts[:1], 4)  # one-off allocations (and CUDA's lazy start) outside the timings
        runs = {}
        for name, k in (("plain", 0),) if plain_only else (("plain", 0), ("speculative", None)):
            began = time.perf_counter()
            result = engine.generate(prompts, max_tokens, num_speculative_tokens=k)
            seconds = time.perf_counter() - began
            runs[name] = {"tokens": result.tokens, "tokens_per_s": sum(map(len, result.tokens)) / seconds}
            runs[name]["metrics"] = result.metrics.to_dict()
        if plain_only:
            return runs
        runs["divergences"] = divergence_evidence(
            engine, prompts, runs["plain"]["tokens"], runs["speculative"]["tokens"]
        )
        state = engine.measure_drafter()  # the drafter's content check: the statistics kernels
        runs["k"] = engine.options.num_speculative_tokens
        runs["drafter_tensors_measured"] = len(state.tensors)
    return runs


def demo_rows(demo: str, device: str, dtype: Dtype, pp_sizes: list[int], max_tokens: int) -> list[dict]:
    prompts = demo_prompts(demo)
    cpu = decode(RuntimeOptions(demo, device="cpu", dtype=dtype), prompts, max_tokens, plain_only=True)
    cpu = cpu["plain"]["tokens"]
    rows = []
    for pp in pp_sizes:
        if device == "cuda" and pp > torch.cuda.device_count():
            rows.append({"model": demo, "pp": pp, "skipped": f"{torch.cuda.device_count()} GPU(s) for {pp} ranks"})
            continue
        # k None: the drafter's own default (3; a DSpark drafter's block size), as serve and check take it
        options = RuntimeOptions(demo, pp=pp, device=device, dtype=dtype, num_speculative_tokens=None)
        runs = decode(options, prompts, max_tokens)
        plain, speculative = runs["plain"], runs["speculative"]
        metrics = speculative["metrics"]
        rows.append({
            "model": demo, "pp": pp, "k": runs["k"],
            "lossless": speculative["tokens"] == plain["tokens"],
            "divergences": runs["divergences"],
            "plain_matches_cpu": plain["tokens"] == cpu,
            "mean_acceptance_length": metrics["mean_acceptance_length"],
            "acceptance_per_position": metrics["per_position_acceptance_rate"],
            "plain_tokens_per_s": plain["tokens_per_s"],
            "speculative_tokens_per_s": speculative["tokens_per_s"],
            "speedup": speculative["tokens_per_s"] / plain["tokens_per_s"],
            "drafter_tensors_measured": runs["drafter_tensors_measured"],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--demos", nargs="+", choices=sorted(DEMO_MODELS), default=sorted(DEMO_MODELS))
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", type=Dtype, choices=list(Dtype), default=Dtype.FLOAT32)
    add_json_option(parser, "gpu_acceptance")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_acceptance: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing was run")
        sys.exit(NO_GPU_EXIT)
    kernels = backend(torch.empty(0, device=args.device))
    rows = [row for demo in args.demos for row in demo_rows(demo, args.device, args.dtype, args.pp, args.max_tokens)]
    settings = {"device": args.device, "kernels": kernels, "dtype": str(args.dtype), "max_tokens": args.max_tokens}
    write_json(args.json, {**settings, "rows": rows})
    title = (
        f"{args.device} ({kernels} kernels), {args.dtype}, 9 battery prompts x {args.max_tokens} tokens, batch 9, "
        "greedy"
    )
    columns = ("model", "PP", "k", "lossless", "= CPU", "accept len", "per position", "plain tok/s", "spec tok/s")
    table = numeric_table(title, columns)
    for row in rows:
        if "skipped" in row:
            table.add_row(row["model"], str(row["pp"]), *["-"] * 6, f"skipped: {row['skipped']}")
            continue
        table.add_row(
            row["model"], str(row["pp"]), str(row["k"]), lossless_label(row),
            "yes" if row["plain_matches_cpu"] else "no", f"{row['mean_acceptance_length']:.2f}",
            " ".join(f"{rate:.2f}" for rate in row["acceptance_per_position"]),
            f"{row['plain_tokens_per_s']:.1f}", f"{row['speculative_tokens_per_s']:.1f}",
        )  # fmt: skip
    Console().print(table)
    sys.exit(0 if all(lossless_label(row) != "NO" for row in rows if "skipped" not in row) else 1)


if __name__ == "__main__":
    main()
