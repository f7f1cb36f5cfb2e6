"""Rolling a Gated DeltaNet layer's recurrent state back after a speculative step, both ways, side by side:

    python -m benchmarks.rollback [--k 3] [--repeats 200] [--json FILE]

keep       the verification pass keeps the state after each of its k + 1 positions and the step commits
           the one after the last accepted token (what specdoctor's runtime does, and vLLM's GDN backend:
           one state slot per speculative position, read back by num_accepted_tokens);
recompute  the verification pass keeps only its inputs; the step re-runs the recurrence over the
           accepted tokens from the state before it.
Per layer and step, at the demo's sizes and at Qwen3-Next-80B's (32 value heads of 128 x 128), batch 1 and
16, a random number of accepted drafts per row; both must give the same state (checked every run).
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.runtime.models.gated_deltanet import delta_rule, l2_normalise

SIZES = {"demo-hybrid": (4, 32, 32), "Qwen3-Next-80B": (32, 128, 128)}  # value heads, key dim, value dim


def step_inputs(batch: int, length: int, heads: int, key_dim: int, value_dim: int, generator):
    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q = l2_normalise(randn(batch, length, heads, key_dim)) * key_dim**-0.5
    k = l2_normalise(randn(batch, length, heads, key_dim))
    g = -torch.rand(batch, length, heads, generator=generator)
    beta = torch.rand(batch, length, heads, generator=generator)
    return q, k, randn(batch, length, heads, value_dim), g, beta, randn(batch, heads, key_dim, value_dim)


def keep(inputs, accepted):
    q, k, v, g, beta, state = inputs
    _, states = delta_rule(q, k, v, g, beta, state, keep_positions=True)
    return states[torch.arange(len(accepted)), accepted]


def recompute(inputs, accepted):
    q, k, v, g, beta, state = inputs
    delta_rule(q, k, v, g, beta, state, keep_positions=False)  # the verification pass: its outputs only
    kept = (torch.arange(q.shape[1]) <= accepted[:, None])[..., None]  # rejected tokens leave the state alone
    longest = int(accepted.max()) + 1
    args = (q[:, :longest], k[:, :longest], v[:, :longest], (g * kept)[:, :longest], (beta * kept)[:, :longest])
    return delta_rule(*args, state, keep_positions=False)[1][:, 0]


def seconds(method, inputs, accepted, repeats: int) -> float:
    method(inputs, accepted)  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        method(inputs, accepted)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=200)
    add_json_option(parser, "rollback")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    generator = torch.Generator().manual_seed(0)
    rows = []
    cases = [(name, batch) for name in SIZES for batch in (1, 16)]
    for name, batch in track(cases, description="rollback: keep vs recompute"):
        heads, key_dim, value_dim = SIZES[name]
        inputs = step_inputs(batch, args.k + 1, heads, key_dim, value_dim, generator)
        accepted = torch.randint(0, args.k + 1, (batch,), generator=generator)
        torch.testing.assert_close(keep(inputs, accepted), recompute(inputs, accepted), rtol=1e-5, atol=1e-6)
        state_mb = batch * heads * key_dim * value_dim * 4 / 1e6
        rows.append(
            {
                "sizes": name,
                "batch": batch,
                "keep_ms": 1e3 * seconds(keep, inputs, accepted, args.repeats),
                "recompute_ms": 1e3 * seconds(recompute, inputs, accepted, args.repeats),
                "keep_extra_mb": (args.k + 1) * state_mb,  # the states of every position, held until the commit
                "state_mb": state_mb,
            }
        )
    table = Table(title=f"state rollback per layer and step, k {args.k} ({machine()}, fp32)")
    for column in ("sizes", "batch", "keep ms", "recompute ms", "recompute / keep", "keep holds extra MB"):
        table.add_column(column)
    for row in rows:
        ratio = row["recompute_ms"] / row["keep_ms"]
        table.add_row(
            row["sizes"],
            str(row["batch"]),
            f"{row['keep_ms']:.3f}",
            f"{row['recompute_ms']:.3f}",
            f"{ratio:.2f}x",
            f"{row['keep_extra_mb']:.2f}",
        )
    Console().print(table)
    write_json(args.json, {"settings": {"k": args.k, "repeats": args.repeats}, "rows": rows})


if __name__ == "__main__":
    main()
