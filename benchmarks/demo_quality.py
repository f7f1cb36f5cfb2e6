"""Quality of a shipped demo model's drafter on held-out standard-library text.

Prints the greedy MTP acceptance at draft position 0 (for demo-dspark: the per-position acceptance of a
greedy block anchored at every position of the trace) and writes JSON:

    python -m benchmarks.demo_quality [--model demo|demo-mla|demo-hybrid|demo-dspark] [--prompts 32]
        [--new-tokens 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.runtime.checkpoint.files import DEMO_MODELS
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.models.dspark import DSparkDrafter
from tests.helpers.acceptance_trace import block_acceptance, position0_acceptance
from tests.helpers.demo_corpus import held_out_prompts
from tests.helpers.loading import load_target_and_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(DEMO_MODELS), default="demo")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    add_json_option(parser, "demo_quality")
    args = parser.parse_args()

    checkpoint = Checkpoint(args.model)
    target, drafter, _ = load_target_and_drafter(checkpoint)
    tokenizer = Tokenizer.from_file(str(checkpoint.path / "tokenizer.json"))
    prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_tokens, args.seed)
    start = time.perf_counter()
    if isinstance(drafter, DSparkDrafter):
        rates = block_acceptance(target, drafter, prompts, args.new_tokens, drafter.config.block_size)
    else:
        rates = [position0_acceptance(target, drafter, prompts, args.new_tokens)]
    result = {
        "machine": machine(),
        "settings": vars(args) | {"json": str(args.json)},
        "position0_acceptance": rates[0],
        "per_position_acceptance": rates,
        "seconds": round(time.perf_counter() - start, 2),
    }
    table = Table(title=f"{args.model} drafter on held-out stdlib text (greedy)")
    table.add_column("metric")
    table.add_column("value")
    table.add_row("acceptance, draft position 0", f"{rates[0]:.1%}")
    if len(rates) > 1:
        table.add_row(f"per position, block {len(rates)}", " ".join(f"{rate:.1%}" for rate in rates))
        table.add_row("mean acceptance length (every anchor; counts the bonus token)", f"{1 + sum(rates):.2f}")
    table.add_row("prompts x new tokens", f"{args.prompts} x {args.new_tokens}")
    table.add_row("machine", result["machine"])
    Console().print(table)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
