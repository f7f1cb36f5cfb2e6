"""Plain greedy decoding, specdoctor's runtime (PP 1, its own rank process) against transformers'
`generate` on the same checkpoint, prompts and token count, measured alternately in one run.

    python -m benchmarks.vs_transformers [--max-tokens 64] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import Glm4MoeForCausalLM

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.battery import load_battery
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from specdoctor.runtime.checkpoint.tokenizer import TextCodec
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions


def transformers_generate(model, prompt: list[int], max_tokens: int, eos: tuple[int, ...]) -> list[int]:
    """New tokens, without the EOS that ends them (specdoctor does not emit it either)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
    new = out[0, len(prompt) :].tolist()
    return new[:-1] if new and new[-1] in eos else new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    add_json_option(parser, "vs_transformers")
    args = parser.parse_args()
    codec = TextCodec(DEMO_DIR / "tokenizer.json")
    prompts = [codec.encode(entry["prompt"]) for entry in load_battery(None)]
    torch.set_num_threads(os.cpu_count() or 1)  # what a PP 1 rank gets
    reference = Glm4MoeForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    # Same stopping rule on both sides: the checkpoint's EOS ids, or the token budget.
    reference.generation_config.eos_token_id = list(codec.eos_token_ids)
    reference.generation_config.pad_token_id = codec.eos_token_ids[0]
    seconds = {"transformers": 0.0, "specdoctor": 0.0, "specdoctor k=3": 0.0}
    tokens = dict.fromkeys(seconds, 0)
    same = True
    with Engine(RuntimeOptions("demo", pp=1), show_progress=True) as engine, torch.inference_mode():
        transformers_generate(reference, prompts[0], 4, codec.eos_token_ids)  # warm-up on both sides
        engine.generate(prompts[:1], 4, num_speculative_tokens=3)
        for _ in range(args.rounds):
            for prompt in prompts:
                start = time.perf_counter()
                theirs = transformers_generate(reference, prompt, args.max_tokens, codec.eos_token_ids)
                seconds["transformers"] += time.perf_counter() - start
                for name, k in (("specdoctor", 0), ("specdoctor k=3", 3)):
                    start = time.perf_counter()
                    ours = engine.generate([prompt], args.max_tokens, num_speculative_tokens=k).tokens[0]
                    seconds[name] += time.perf_counter() - start
                    tokens[name] += len(ours)
                    same &= ours == theirs
                tokens["transformers"] += len(theirs)
    rates = {name: tokens[name] / seconds[name] for name in seconds}
    table = Table(title=f"Greedy, demo model, {len(prompts)} prompts x {args.max_tokens} tokens x {args.rounds} rounds")
    for column in ("decoder", "tokens", "seconds", "tok/s", "vs transformers"):
        table.add_column(column, justify="right")
    for name in seconds:
        table.add_row(
            name,
            str(tokens[name]),
            f"{seconds[name]:.2f}",
            f"{rates[name]:.1f}",
            f"{rates[name] / rates['transformers']:.2f}x",
        )
    console = Console(width=160)
    console.print(table)
    console.print(f"same tokens as transformers: {'yes' if same else 'NO'}; machine: {machine()}")
    write_json(
        args.json,
        {
            "settings": {**vars(args), "json": str(args.json)},
            "seconds": seconds,
            "tokens": tokens,
            "tokens_per_s": rates,
            "same_tokens": same,
        },
    )


if __name__ == "__main__":
    main()
