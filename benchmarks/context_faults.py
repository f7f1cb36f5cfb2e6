"""Position-0 acceptance by context length for each demo drafter, healthy and with `--fault drafter-rope-past=N`:
what the context sweep has to find, and why the wrap fault is not something it can.

    python -m benchmarks.context_faults [--prompts 16] [--past 256] [--json FILE]

Each server (`specdoctor serve`, PP 1, fp32, eager, the demo's own k) answers the same corpus prompts at each
of the probe tests' context lengths, prompt i of every length starting at the same place, as the context
sweep sends them; the figures are the server's per-request counters, summed.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import track

from benchmarks.common import add_json_option, numeric_table, write_json
from benchmarks.probe_rates import CONTEXT_LENGTHS, Case, pool, window_of
from specdoctor.probe.acceptance_sweeps import prompt_tokens

MODELS = ("demo", "demo-dspark", "demo-eagle3")


def buckets(model: str, fault: str | None, prompts: int) -> list[dict]:
    """Each length's mean prompt tokens and position-0 rate over the first `prompts` corpus prompts."""
    rows = []
    for group in pool(Case("context", model, fault), prompts):
        window = window_of(group)
        accepted, drafts = window.position0
        rows.append({"tokens": prompt_tokens(window), "position0": accepted / drafts, "drafts": drafts})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--past", type=int, default=256, help="the fault's N")
    add_json_option(parser, "context_faults")
    args = parser.parse_args()
    cases = [(model, fault) for model in MODELS for fault in (None, f"drafter-rope-past={args.past}")]
    rows = [
        {"model": model, "fault": fault, "buckets": buckets(model, fault, args.prompts)}
        for model, fault in track(cases, "servers")
    ]
    table = numeric_table("position-0 acceptance by prompt length", ("model", "server", *map(str, CONTEXT_LENGTHS)))
    for row in rows:
        rates = [f"{b['position0']:.1%} ({b['tokens']})" for b in row["buckets"]]
        table.add_row(row["model"], row["fault"] or "healthy", *rates)
    console = Console()
    console.print(table)
    write_json(args.json, {"prompts": args.prompts, "lengths": CONTEXT_LENGTHS, "cases": rows})


if __name__ == "__main__":
    main()
