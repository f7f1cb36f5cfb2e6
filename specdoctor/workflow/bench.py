"""`bench`: speculative against plain decoding in the pipeline runtime, with the time split per step.

Every configuration decodes the same prompts (the battery) to the same length; speculative output is
compared with plain output, so a speed-up that changes the text is reported, not hidden.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.options import RuntimeOptions

SCHEMA = "specdoctor.bench/1"


@dataclass(frozen=True)
class BenchOptions:
    runtime: RuntimeOptions  # everything but the swept fields
    pp_sizes: list[int]
    speculative_tokens: list[int]  # k values to compare with plain decoding (k = 0, always measured)
    max_tokens: int = 64
    batch_size: int = 1
    battery: Path | None = None


@dataclass
class Measurement:
    tokens: list[list[int]]
    seconds: float
    metrics: SpecMetrics
    rank_times: list[dict[str, float]]  # summed over the batches

    @property
    def steps(self) -> float:
        """Decode steps, counted on the last rank (at least 1, so per-step figures of a run without any stay 0)."""
        return max(1.0, self.rank_times[-1]["steps"])

    @property
    def tokens_per_s(self) -> float:
        return sum(map(len, self.tokens)) / self.seconds


def measure(engine, prompts: list[list[int]], k: int, options: BenchOptions, advance) -> Measurement:
    result = Measurement([], 0.0, SpecMetrics(), [])
    for start in range(0, len(prompts), options.batch_size):
        began = time.perf_counter()
        out = engine.generate(prompts[start : start + options.batch_size], options.max_tokens, num_speculative_tokens=k)
        result.seconds += time.perf_counter() - began
        result.tokens += out.tokens
        result.metrics.add(out.metrics)
        result.rank_times = [
            {name: mine.get(name, 0.0) + value for name, value in theirs.items()}
            for mine, theirs in zip(result.rank_times or [{}] * len(out.rank_times), out.rank_times, strict=True)
        ]
        advance()
    return result


PHASES = ("target", "draft", "transfer", "host")


def phase_ms(run: Measurement) -> dict[str, float]:
    """ms per decode step by phase on the last rank, which does every kind of work: target layers, drafting,
    waiting. target: the step's pass (one position plain, k + 1 verifying) with its head and decision."""
    last = run.rank_times[-1]
    return {phase: 1000 * last[f"{phase}_s"] / run.steps for phase in PHASES}


def pass_ms(run: Measurement) -> float:
    """The target's pass per decode step through the whole pipeline: every stage's target time, one after the
    other (a step's pass goes stage by stage), with the last stage's head and decision."""
    return 1000 * sum(stage["target_s"] for stage in run.rank_times) / run.steps


def speedup_bound(k: int, length: float, run: Measurement, plain: Measurement) -> float | None:
    """What the model's own costs allow: L × t_plain ÷ (t_verify + k × t_draft), from the plain pass, the verify
    pass and the k draft steps as measured; the gap to the measured speed-up is the runtime's overhead (host work
    between steps, transfers, prefill, messages). None when no decode step ran (every prompt ended at once)."""
    if not k:
        return 1.0
    plain_ms, spent_ms = pass_ms(plain), pass_ms(run) + phase_ms(run)["draft"]
    return length * plain_ms / spent_ms if plain_ms and spent_ms else None


def bench_row(pp: int, k: int, run: Measurement, plain: Measurement, divergences: list[dict]) -> dict:
    speedup = run.tokens_per_s / plain.tokens_per_s
    length = run.metrics.mean_acceptance_length if k else 1.0
    bound = speedup_bound(k, length, run, plain)
    split = phase_ms(run)
    return {
        "pp": pp,
        "k": k,
        "tokens": sum(map(len, run.tokens)),
        "seconds": run.seconds,
        "tokens_per_s": run.tokens_per_s,
        "speedup": speedup,
        "mean_acceptance_length": length,
        "acceptance_rate": run.metrics.acceptance_rate,
        "num_drafts": run.metrics.num_drafts,
        "speedup_per_acceptance_length": speedup / length,
        "speedup_bound": bound,
        "speedup_of_bound": speedup / bound if bound else None,
        "draft_step_ms": split["draft"] / k if k else 0.0,
        "lossless": run.tokens == plain.tokens,
        "divergences": divergences,  # where each differing prompt first differs, and the target's logits there
        "steps": int(run.steps),
        "step_ms": 1000 * run.rank_times[-1]["decode_s"] / run.steps,
        "last_rank_ms_per_step": split,
        "rank_times": run.rank_times,
    }


def run_bench(options: BenchOptions, show_progress: bool) -> dict:
    from specdoctor.battery import battery_prompts
    from specdoctor.checks.behaviour import divergence_evidence
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.checkpoint.tokenizer import load_codec
    from specdoctor.runtime.engine import Engine

    if options.batch_size < 1 or options.max_tokens < 1:
        raise SpecdoctorError("--batch-size and --max-tokens must be at least 1")
    checkpoint = Checkpoint(options.runtime.model)
    checkpoint.require_runnable()
    prompts, _ = battery_prompts(options.battery, checkpoint, load_codec(checkpoint, options.runtime.tokenizer))
    ks = sorted(set(options.speculative_tokens) - {0})
    batches = -(-len(prompts) // options.batch_size)
    rows = []
    with Progress(console=Console(stderr=True), disable=not show_progress, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(options.pp_sizes) * (len(ks) + 1) * batches)
        for pp in options.pp_sizes:
            runtime = dataclasses.replace(options.runtime, pp=pp)
            with Engine(runtime, checkpoint, show_progress=show_progress) as engine:
                # A short run per k and batch size first: the first call pays one-off allocations and lazy imports
                # and, compiled, asks for the graphs of its shapes (a last, smaller batch may have shapes of its own).
                for k in [0, *ks]:
                    for batch in {options.batch_size, len(prompts) % options.batch_size or options.batch_size}:
                        engine.generate(prompts[:batch], 4, num_speculative_tokens=k)
                finish_compiles(engine, progress, task)
                plain = measure(engine, prompts, 0, options, lambda: progress.advance(task))
                rows.append(bench_row(pp, 0, plain, plain, []))
                for k in ks:
                    run = measure(engine, prompts, k, options, lambda: progress.advance(task))
                    divergences = divergence_evidence(engine, prompts, plain.tokens, run.tokens)
                    rows.append(bench_row(pp, k, run, plain, divergences))
    return {
        "schema": SCHEMA,
        "model": str(checkpoint.path),
        "prompts": len(prompts),
        "settings": {
            "max_tokens": options.max_tokens,
            "batch_size": options.batch_size,
            "tp": options.runtime.tp,
            "drafter_policy": str(options.runtime.drafter_policy),
            "device": str(options.runtime.device),
            "dtype": str(options.runtime.dtype),
            "compiled": options.runtime.compile,
            "greedy": True,
        },
        "rows": rows,
    }


def finish_compiles(engine, progress: Progress, task) -> None:
    """Compiled: wait for the graphs the warm-up runs asked for (compiled behind them), so the timed runs run them."""
    from specdoctor.runtime.compile_status import compile_totals

    def show(statuses) -> None:
        totals = compile_totals(statuses)
        progress.update(task, description=f"compiling: {totals['finished']} of {totals['requested']} graphs")

    engine.on_compile_status = show
    engine.finish_compiles()
    engine.on_compile_status = None
    progress.update(task, description="benchmarking")
