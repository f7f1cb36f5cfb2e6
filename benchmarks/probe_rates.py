"""`probe`'s acceptance decisions at a nominal alpha that many runs resolve: each sweep's false-positive rate on
healthy servers and each fault's power, with their binomial intervals.

    python -m benchmarks.probe_rates [--runs 1000] [--alpha 0.05] [--json FILE]

The servers (`specdoctor serve`, PP 1, fp32, eager) answer a pool of prompts once, each request's own counters
kept: every corpus start at every context length, 64 corpus prompts at each concurrency level. A run draws its prompts
from the pool at random, as a probe with other prompts would send, and is decided by the sweep's own code
(`compare_groups`, sized as `context_sweep` sizes itself) at `--alpha`. Runs differ in their prompts, not in a
server's numerics: a deterministic server gives the same counts for the same prompt, which is why the pools
hold 64 prompts (the corpus's starts). The intervals are over those draws: they say how well 1,000 runs pin the
rule's rate on these pools, not how a rate varies between servers. The prefix-cache sweep is measured in fresh
runs only (`probe_fresh_runs.py`): a pool froze one history of the server's cache, on which its fault's effect
depends, and said 100 % where fresh runs found it in 70 % and 40 % (docs/probe.md §Fresh runs).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from rich.console import Console
from rich.progress import track

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from specdoctor.probe.acceptance_sweeps import (
    CONCURRENCY_MIN_PROMPTS,
    CONCURRENCY_PROMPT_CHARS,
    CONTEXT_KEEP,
    CONTEXT_SIZED_FOR,
    MIN_SWEEP_PROMPTS,
    chars_per_token,
    compare_groups,
)
from specdoctor.probe.client import Probe, Window
from specdoctor.probe.corpus import STARTS, corpus_prompt
from specdoctor.probe.options import ProbeOptions
from specdoctor.probe.stats import prompts_for_power, rate_upper_bound
from specdoctor.runtime.decode.metrics import SpecMetrics
from tests.helpers.servers import SpecdoctorServer

CONTEXT_LENGTHS = (128, 512, 1500)  # the probe tests' buckets under the demo's 2,048 tokens
CONCURRENCY = (1, 4, 16)


@dataclass(frozen=True)
class Case:
    sweep: str
    model: str
    fault: str | None  # None: healthy
    dtype: str = "float32"  # bfloat16: numerics that vary with what is computed together (the batch)
    engine: str = "specdoctor"  # vllm: vLLM's CPU build serves it (probe_fresh_runs.py), fp32, MTP k 3, eager

    @property
    def serve_args(self) -> tuple[str, ...]:
        faulty = ("--fault", self.fault, "--allow-unhealthy") if self.fault else ()
        return (*faulty, "--dtype", self.dtype)


CASES = (
    Case("context", "demo", None),
    Case("context", "demo", "drafter-max-position=1024"),
    Case("context", "demo-dspark", None),
    Case("context", "demo-dspark", "drafter-rope-past=256"),
    Case("context", "demo-eagle3", None),  # no fault: a head trained on 128-token sequences, run past that
    Case("concurrency", "demo", None),
    Case("concurrency", "demo", "stale-batch-rows"),
)


def pool(case: Case, prompts: int = STARTS) -> list[list]:
    """Per condition (bucket, cold/warm, level), each prompt's reply and counters: [(reply, SpecMetrics)]; the
    first `prompts` of the corpus' starts."""
    server = SpecdoctorServer(*case.serve_args, model=case.model)
    try:
        probe = Probe(ProbeOptions(server.url, timeout=3600.0))
        model = probe.served_model().model
        if case.sweep == "context":
            per_token = chars_per_token(probe, probe.served_model())
            groups = [[corpus_prompt(i, int(length * per_token)) for i in range(prompts)] for length in CONTEXT_LENGTHS]
            windows = [probe.measure(model, prompts) for prompts in groups]
        else:  # the sweep's own prompts, 64 of them, at each level
            group = [corpus_prompt(i, CONCURRENCY_PROMPT_CHARS) for i in range(prompts)]
            windows = [probe.measure(model, group, concurrency=level) for level in CONCURRENCY]
    finally:
        server.stop()
    return [list(zip(window.replies, window.units, strict=True)) for window in windows]


def window_of(entries: list) -> Window:
    """A group of these (reply, counters) entries, as `Probe.measure` gives it."""
    total = SpecMetrics()
    for _, unit in entries:
        total.add(unit)
    return Window("per-request", total, [reply for reply, _ in entries], [], [unit for _, unit in entries])


def one_run(case: Case, groups: list[list], rng: random.Random, alpha: float) -> bool:
    """Whether one run, its prompts drawn from the pool, fails the sweep."""
    size = len(groups[0])
    if case.sweep == "context":
        alpha_each = alpha / (len(groups) - 1)
        first = rng.sample(range(size), MIN_SWEEP_PROMPTS)
        needed = prompts_for_power(
            window_of([groups[0][i] for i in first]).position0_units, CONTEXT_SIZED_FOR, CONTEXT_KEEP, alpha_each
        )
        count = min(size, max(needed, MIN_SWEEP_PROMPTS))
        chosen = first + rng.sample([i for i in range(size) if i not in first], count - MIN_SWEEP_PROMPTS)
        windows = [window_of([group[i] for i in chosen]) for group in groups]
        labels = [f"{length} tokens" for length in CONTEXT_LENGTHS]
        sweep = compare_groups("context", windows, labels, None, "", cliff=True, keep=CONTEXT_KEEP, alpha=alpha)
    else:
        count = max(CONCURRENCY[-1], CONCURRENCY_MIN_PROMPTS)
        chosen = rng.sample(range(size), count)
        windows = [window_of([group[i] for i in chosen]) for group in groups]
        sweep = compare_groups(case.sweep, windows, [str(n) for n in range(len(groups))], None, "", alpha=alpha)
    return sweep.status == "failed"


def interval(failures: int, runs: int) -> tuple[float, float]:
    """Wilson's 95 % interval on a rate: each side the one-sided bound at 2.5 % (the lower one that of the
    complement's rate)."""
    lower = 1 - rate_upper_bound(runs - failures, runs, 0.025)
    return round(max(0.0, lower), 4), round(rate_upper_bound(failures, runs, 0.025), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--alpha", type=float, default=0.05)
    add_json_option(parser, "probe_rates")
    args = parser.parse_args()
    console, rng, rows = Console(), random.Random(0), []
    for case in track(CASES, "pools"):
        groups = pool(case)
        failed = sum(one_run(case, groups, rng, args.alpha) for _ in range(args.runs))
        rows.append(
            {
                "sweep": case.sweep,
                "model": case.model,
                "fault": case.fault,
                "pool": len(groups[0]),
                "runs": args.runs,
                "failed": failed,
                "rate": failed / args.runs,
                "interval_95": interval(failed, args.runs),
            }
        )
    table = numeric_table(
        f"share of runs failing at alpha {args.alpha:g}", ("sweep", "model", "fault", "failed", "95 % interval")
    )
    for row in rows:
        low, high = row["interval_95"]
        table.add_row(
            row["sweep"], row["model"], row["fault"] or "healthy", f"{row['rate']:.1%}", f"{low:.1%}-{high:.1%}"
        )
    console.print(table)
    results = {"machine": machine(), "alpha": args.alpha, "runs": args.runs, "cases": rows}
    console.print(f"machine: {results['machine']}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
