"""How long the prefix-cache sweep's requests should be: the evidence a cold/warm comparison gathers against
`prefix-cache-drafter-kv` per second of the server's time, at each max_tokens.

    python -m benchmarks.prefix_design [--tokens 8,16,32,64] [--prompts 64] [--seeds 3] [--json FILE]

For each demo drafter, one `specdoctor serve --fault prefix-cache-drafter-kv` (PP 1, fp32, eager); for each seed
and each max_tokens, `--prompts` prompts of the sweep's own length, sized, sent and compared as the sweep does
them (rounds of cold then warm; the paired test at ALPHA), each seed's prompts from their own places in the
corpus. Evidence is the test's p-value as a normal quantile, z; z squared over the seconds the requests took is
what a second buys (a sweep's z grows with the square root of its prompts).
"""

from __future__ import annotations

import argparse
import time
from statistics import NormalDist

from rich.console import Console
from rich.progress import Progress

from benchmarks.common import add_json_option, numeric_table, write_json
from specdoctor.probe.acceptance_sweeps import (
    chars_per_token,
    compare_groups,
    joined,
    prefix_prompt_tokens,
    prefix_rounds,
)
from specdoctor.probe.client import Probe
from specdoctor.probe.options import ProbeOptions, SweepOptions
from specdoctor.probe.stats import fall_p_value
from tests.helpers.servers import SpecdoctorServer

MODELS = ("demo", "demo-dspark")


def one_design(probe: Probe, found: tuple[int, float], prompts: int, max_tokens: int, seed: int) -> dict:
    served, started = probe.served_model(), time.monotonic()
    rounds = prefix_rounds(probe, served, range(prompts), found, seed, max_tokens)
    if isinstance(rounds, str):
        raise RuntimeError(rounds)
    cold, warm = joined([part.cold for part in rounds]), joined([part.warm for part in rounds])
    p_value = fall_p_value(cold.position0_units, warm.position0_units, paired=True)
    verdict = compare_groups("prefix-cache", [cold, warm], ["cold", "warm"], None, "").status
    (cold_hits, cold_drafts), (warm_hits, warm_drafts) = cold.position0, warm.position0
    z = NormalDist().inv_cdf(1 - max(p_value, 1e-300))
    seconds = time.monotonic() - started
    return {
        "seed": seed,
        "max_tokens": max_tokens,
        "cold_position0": round(cold_hits / cold_drafts, 4),
        "warm_position0": round(warm_hits / warm_drafts, 4),
        "p_value": p_value,
        "z": round(z, 2),
        "seconds": round(seconds, 1),
        "z2_per_second": round(z * z / seconds, 3),
        "failed_at_alpha": verdict == "failed",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="8,16,32,64", help="the max_tokens compared")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    add_json_option(parser, "prefix_design")
    args = parser.parse_args()
    designs = [int(value) for value in args.tokens.split(",")]
    console, rows = Console(), []
    with Progress(console=console) as progress:
        task = progress.add_task("designs", total=len(MODELS) * args.seeds * len(designs))
        for model in MODELS:
            server = SpecdoctorServer("--fault", "prefix-cache-drafter-kv", "--allow-unhealthy", model=model)
            try:
                probe = Probe(ProbeOptions(server.url, timeout=3600.0))
                served = probe.served_model()
                found = prefix_prompt_tokens(probe, served, SweepOptions(), chars_per_token(probe, served))
                if isinstance(found, str):
                    raise RuntimeError(found)
                for seed in range(1, args.seeds + 1):
                    for max_tokens in designs:
                        rows.append({"model": model, **one_design(probe, found, args.prompts, max_tokens, seed)})
                        progress.advance(task)
                        write_json(args.json, {"prompts": args.prompts, "prompt_tokens": found[0], "runs": rows})
            finally:
                server.stop()
    table = numeric_table(
        f"prefix-cache-drafter-kv, {args.prompts} prompts cold then warm",
        ("model", "max_tokens", "seed", "position 0 cold", "warm", "z", "seconds", "z² per second"),
    )
    for row in rows:
        table.add_row(
            row["model"],
            str(row["max_tokens"]),
            str(row["seed"]),
            f"{row['cold_position0']:.1%}",
            f"{row['warm_position0']:.1%}",
            f"{row['z']:.2f}",
            f"{row['seconds']:.1f}",
            f"{row['z2_per_second']:.2f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
