"""The decode step of one rank, eager against `--compile`, side by side in one process (PP 1, the demo):
top-level ops per step (the profiler's count, deterministic where seconds are noisy), ms per step, the
speculative speed-up and its ratio to the mean acceptance length, and the plain step against the
weight-streaming floor (the bytes one plain step must read, at this machine's measured copy bandwidth).
For PP 4 use `specdoctor bench --pp 4 [--no-compile]`.

    python -m benchmarks.step_profile [--rounds 3] [--max-tokens 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.progress import Progress
from torch.profiler import profile

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from specdoctor.battery import battery_prompts
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import load_codec
from specdoctor.runtime.decode.batch import decode_batch
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.decode.requests import GenerateRequest
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.runtime.rank_process import keep_freed_memory_mapped

MODES = {"eager": False, "compiled": True}
KS = (0, 3)


def copy_bandwidth(megabytes: int = 256, repeats: int = 10) -> float:
    """Bytes copied per second (each read once and written once), best of `repeats`."""
    source = torch.randn(megabytes << 18)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return source.nbytes / best


def bytes_per_plain_step(stage, config) -> int:
    """The weight bytes one token's step reads: every parameter, but one embedding row and, in each MoE
    layer, only the routed experts a token picks (top-k of n)."""
    total = 0
    for name, parameter in stage.named_parameters():
        if name.startswith("model.embed_tokens"):
            total += parameter[0].nbytes
        elif ".mlp.experts." in name:
            total += parameter.nbytes * config.num_experts_per_tok // config.n_routed_experts
        else:
            total += parameter.nbytes
    return total


def run_prompts(model, prompts, k: int, max_tokens: int) -> tuple[float, int, int, SpecMetrics]:
    """(decode seconds, decode steps, tokens, acceptance counters) over the prompts one at a time."""
    seconds, steps, tokens, metrics = 0.0, 0, 0, SpecMetrics()
    for prompt in prompts:
        result = decode_batch(model, GenerateRequest([prompt], max_tokens, num_speculative_tokens=k))
        seconds += result.rank_times[0]["decode_s"]
        steps += int(result.rank_times[0]["steps"])
        tokens += len(result.tokens[0])
        metrics.add(result.metrics)
    return seconds, steps, tokens, metrics


def ops_per_step(model, prompt, k: int, max_tokens: int) -> float:
    with profile() as trace:
        result = decode_batch(model, GenerateRequest([prompt], max_tokens, num_speculative_tokens=k))
    return sum(1 for event in trace.events() if event.cpu_parent is None) / result.rank_times[0]["steps"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="eager and compiled alternate; the median is kept")
    parser.add_argument("--max-tokens", type=int, default=64)
    add_json_option(parser, "step_profile")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())  # what a PP 1 rank runs with: every core
    keep_freed_memory_mapped()
    checkpoint = Checkpoint("demo")
    prompts = battery_prompts(None, checkpoint, load_codec(checkpoint, None))[0]
    models = {mode: load_rank(RuntimeOptions("demo", compile=flag), 0)[0] for mode, flag in MODES.items()}
    samples = {(mode, k): [] for mode in MODES for k in KS}
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("warming up (compiling)", total=len(MODES) * len(KS) * (1 + args.rounds))
        for model in models.values():
            for k in KS:  # compiles every shape the measured runs meet
                run_prompts(model, prompts[:2], k, 8)
                progress.advance(task)
        progress.update(task, description="measuring")
        for _ in range(args.rounds):
            for mode, model in models.items():
                for k in KS:
                    samples[mode, k].append(run_prompts(model, prompts, k, args.max_tokens))
                    progress.advance(task)
    bandwidth = copy_bandwidth()
    floor_ms = 1000 * bytes_per_plain_step(models["eager"].stage, checkpoint.config) / bandwidth
    rows = []
    for mode, model in models.items():
        plain_ms = None
        for k in KS:
            runs = samples[mode, k]
            step_ms = statistics.median(1000 * seconds / steps for seconds, steps, _, _ in runs)
            tok_per_s = statistics.median(tokens / seconds for seconds, _, tokens, _ in runs)
            length = runs[0][3].mean_acceptance_length if k else 1.0
            plain_ms = plain_ms or step_ms
            speedup = plain_ms * length / step_ms  # tokens per unit time against this mode's plain steps
            rows.append(
                {
                    "mode": mode,
                    "k": k,
                    "ops_per_step": ops_per_step(model, prompts[0], k, args.max_tokens),
                    "step_ms": step_ms,
                    "tokens_per_s": tok_per_s,
                    "mean_acceptance_length": length,
                    "speedup": speedup,
                    "speedup_per_acceptance_length": speedup / length,
                    "floor_ratio": step_ms / floor_ms if k == 0 else None,
                    "tokens": [tokens for _, _, tokens, _ in runs][0],
                }
            )
    table = numeric_table(
        f"decode step at PP 1 (the demo, batch 1, {args.max_tokens} tokens x {len(prompts)} prompts)",
        ("mode", "k", "ops/step", "ms/step", "tok/s", "acc. length", "speed-up", "÷ length", "÷ floor"),
    )
    for row in rows:
        table.add_row(
            row["mode"],
            str(row["k"]),
            f"{row['ops_per_step']:.0f}",
            f"{row['step_ms']:.2f}",
            f"{row['tokens_per_s']:.0f}",
            f"{row['mean_acceptance_length']:.2f}",
            f"{row['speedup']:.2f}x",
            f"{row['speedup_per_acceptance_length']:.2f}",
            f"{row['floor_ratio']:.2f}x" if row["floor_ratio"] else "",
        )
    console = Console(width=160)
    console.print(table)
    console.print(
        f"weight-streaming floor of a plain step: {floor_ms:.2f} ms "
        f"({bytes_per_plain_step(models['eager'].stage, checkpoint.config) / 1e6:.2f} MB at {bandwidth / 1e9:.1f} GB/s)"
    )
    console.print(f"machine: {machine()}")
    write_json(args.json, {"floor_ms": floor_ms, "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
