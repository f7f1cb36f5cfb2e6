"""Quality of the shipped demo model's drafter on held-out standard-library text.

Prints the greedy MTP acceptance at draft position 0 and writes JSON:

    python -m benchmarks.demo_quality [--prompts 32] [--new-tokens 64] [--json runs/demo_quality.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from benchmarks.common import machine, write_json
from specdoctor.demo_corpus import corpus_files, read_texts
from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.loader import load_drafter, load_target_stage
from specdoctor.runtime.trace_acceptance import position0_acceptance


def held_out_prompts(tokenizer: Tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    eos = tokenizer.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(read_texts(corpus_files()[1])):
        stream += encoding.ids + [eos]
    offsets = torch.randint(0, len(stream) - length, (count,), generator=torch.Generator().manual_seed(seed))
    return [stream[o : o + length] for o in offsets.tolist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, default=Path("runs/demo_quality.json"))
    args = parser.parse_args()

    checkpoint = Checkpoint("demo")
    target = load_target_stage(checkpoint, range(checkpoint.config.num_hidden_layers), True, True)
    drafter, _ = load_drafter(checkpoint)
    tokenizer = Tokenizer.from_file(str(checkpoint.path / "tokenizer.json"))
    prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_tokens, args.seed)
    start = time.perf_counter()
    acceptance = position0_acceptance(target, drafter, prompts, args.new_tokens)
    result = {
        "machine": machine(),
        "settings": vars(args) | {"json": str(args.json)},
        "position0_acceptance": acceptance,
        "seconds": round(time.perf_counter() - start, 2),
    }
    table = Table(title="Demo model drafter on held-out stdlib text (greedy)")
    table.add_column("metric")
    table.add_column("value")
    table.add_row("MTP acceptance, draft position 0", f"{acceptance:.1%}")
    table.add_row("prompts x new tokens", f"{args.prompts} x {args.new_tokens}")
    table.add_row("machine", result["machine"])
    Console().print(table)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
