"""What tensor parallelism costs on this machine: decode speed of the demo at TP 2 beside TP 1 (PP 1), plain and
speculative (k 3), at batch 1 and 8. Each TP size runs in its own engine, the two alternating round by round so
that the machine's noise falls on both; the figure is the median of the rounds' decode tokens/s (prefill left out).

    python -m benchmarks.tensor_parallel [--rounds 3] [--max-tokens 48] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions

PROMPT = [5, 9, 14, 3, 77, 41, 8, 19, 101, 7, 300, 12]


def decode_rate(engine: Engine, batch: int, k: int, max_tokens: int) -> float:
    """Tokens the batch decoded per second after the prompt pass (the first rank's clock)."""
    prompts = [PROMPT[row % len(PROMPT) :] + PROMPT[: row % len(PROMPT)] for row in range(batch)]
    result = engine.generate(prompts, max_tokens, num_speculative_tokens=k)
    decoded = sum(len(tokens) - 1 for tokens in result.tokens)  # the prompt pass emits each row's first
    return decoded / result.rank_times[0]["decode_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    add_json_option(parser, "tensor_parallel")
    args = parser.parse_args()
    cases = [(batch, k) for batch in (1, 8) for k in (0, 3)]
    rates: dict[tuple[int, int, int], list[float]] = {}
    engines = {tp: Engine(RuntimeOptions("demo", tp=tp, num_speculative_tokens=3)) for tp in (1, 2)}
    try:
        for engine in engines.values():  # warm-up: first calls allocate
            decode_rate(engine, 8, 3, 8)
        for _ in range(args.rounds):
            for batch, k in cases:
                for tp, engine in engines.items():
                    rates.setdefault((tp, batch, k), []).append(decode_rate(engine, batch, k, args.max_tokens))
    finally:
        for engine in engines.values():
            engine.close()
    table = numeric_table(
        "Demo decode tokens/s, TP 2 beside TP 1 (PP 1)", ("batch", "k", "TP 1", "TP 2", "TP 2 / TP 1")
    )
    rows = []
    for batch, k in cases:
        one, two = (statistics.median(rates[tp, batch, k]) for tp in (1, 2))
        table.add_row(str(batch), str(k), f"{one:.1f}", f"{two:.1f}", f"{two / one:.2f}")
        rows.append({"batch": batch, "k": k, "tp1_tokens_per_s": one, "tp2_tokens_per_s": two, "ratio": two / one})
    console = Console(width=120)
    console.print(table)
    console.print(f"machine: {machine()}; {args.rounds} rounds of {args.max_tokens} tokens per row")
    write_json(args.json, {"rows": rows, "rounds": args.rounds, "max_tokens": args.max_tokens})


if __name__ == "__main__":
    main()
