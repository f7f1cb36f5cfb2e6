"""Acceptance on a demo model, in the pipeline runtime, healthy at k 1-5 and for each broken loading (each
drafter's own faults: MTP embedding and head; DSpark's also the Markov head and the taps; EAGLE-3's the aux
states).

    python -m benchmarks.acceptance [--model demo|demo-mla|demo-hybrid|demo-dspark|demo-eagle3] [--pp 4] [--prompts 16]
        [--new-tokens 64] [--k 3] [--json FILE]

Every speculative run is checked against plain greedy output (lossless: yes/no).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.errors import PipelineError
from specdoctor.runtime.checkpoint.files import DEMO_MODELS
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from tests.helpers.demo_corpus import held_out_prompts

# Each broken loading: the RuntimeOptions that reproduce it.
BROKEN = [
    dict(drafter_policy="engine-legacy", fill="empty"),
    dict(drafter_policy="engine-legacy", fill="zeros"),
    dict(drafter_policy="engine-legacy", fill="nan"),
    dict(drafter_policy="engine-legacy", fill="stale"),
    dict(drafter_policy="alias-placeholder"),
    dict(head_policy="unloaded", fill="nan"),
]
DSPARK_BROKEN = [
    *BROKEN,
    dict(markov_policy="unloaded", fill="zeros"),
    dict(markov_policy="unloaded", fill="nan"),
    dict(markov_policy="unloaded", fill="empty"),
    dict(tap_policy="local-only"),
    dict(tap_policy="off-by-one"),
]
EAGLE3_BROKEN = [*BROKEN, dict(tap_policy="local-only"), dict(tap_policy="off-by-one")]
FAULTS = {"mtp": BROKEN, "dspark": DSPARK_BROKEN, "eagle3": EAGLE3_BROKEN}  # by the drafter kind's name


def label(faults: dict) -> str:
    return ", ".join(f"{name.removesuffix('_policy')} {value}" for name, value in faults.items()) or "fixed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(DEMO_MODELS), default="demo")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--k", type=int, default=None, help="draft tokens of the broken rows (default: the drafter kind's own)"
    )
    add_json_option(parser, "acceptance")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(DEMO_MODELS[args.model] / "tokenizer.json"))
    prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_tokens, args.seed)

    rows = []
    with Engine(RuntimeOptions(args.model, pp=args.pp), show_progress=True) as engine:
        plain = engine.generate(prompts, args.new_tokens).tokens
        broken_k = args.k or engine.drafter.default_speculative_tokens()
        for k in range(1, 6):
            result = engine.generate(prompts, args.new_tokens, num_speculative_tokens=k)
            rows.append(("fixed", k, result.tokens == plain, result.metrics.to_dict()))
        faults = FAULTS[engine.drafter.name]
    for fault in faults:
        with Engine(RuntimeOptions(args.model, pp=args.pp, **fault), show_progress=True) as engine:
            try:
                result = engine.generate(prompts, args.new_tokens, num_speculative_tokens=broken_k)
                rows.append((label(fault), broken_k, result.tokens == plain, result.metrics.to_dict()))
            except PipelineError as crash:  # an aliased placeholder fails the first draft step, as in vLLM
                rows.append((label(fault), broken_k, None, {"crash": str(crash).splitlines()[0]}))

    table = Table(
        title=f"{args.model}, PP {args.pp}, {args.prompts} held-out prompts x {args.new_tokens} tokens, greedy"
    )
    for column in ("loading", "k", "lossless", "acceptance rate", "mean acceptance length*", "per-position rates"):
        table.add_column(column)
    for loading, k, lossless, m in rows:
        if "crash" in m:
            table.add_row(loading, str(k), "crashed", "-", "-", m["crash"][:60])
            continue
        table.add_row(
            loading,
            str(k),
            "yes" if lossless else "NO",
            f"{m['acceptance_rate']:.1%}",
            f"{m['mean_acceptance_length']:.2f}",
            " ".join(f"{r:.0%}" for r in m["per_position_acceptance_rate"]),
        )
    console = Console()
    console.print(table)
    console.print("* mean acceptance length = 1 + accepted / drafts: it counts the bonus token.")
    console.print(f"machine: {machine()}")
    keys = ("loading", "k", "lossless", "metrics")
    rows_json = [dict(zip(keys, row, strict=True)) for row in rows]
    write_json(args.json, {"settings": {**vars(args), "json": str(args.json)}, "rows": rows_json})


if __name__ == "__main__":
    main()
