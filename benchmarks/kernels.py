"""Each kernel against its torch reference and against the memory-bandwidth floor.

    python -m benchmarks.kernels                 # CPU: times the torch reference path (what the CPU runs)
    python -m benchmarks.kernels --device cuda   # GPU: Triton vs torch vs floor, one table

The floor is bytes moved / measured copy bandwidth (a clone of a large buffer on the same device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.kernels import reference


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    buffer = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    seconds = timed(lambda: buffer.clone(), device, 5)
    return 2 * buffer.numel() / seconds  # read + write


def cases(device: torch.device, vocab: int, hidden: int, batch: int, k: int):
    """(name, shape note, bytes moved, reference callable, triton callable name, arguments)."""
    g = torch.Generator(device=device).manual_seed(0)
    table = torch.randn(vocab, hidden, generator=g, device=device).to(torch.bfloat16)
    rows = torch.linspace(0, vocab - 1, 64, device=device).long()
    projection = torch.randn(hidden, generator=g, device=device)
    n = batch * k
    drafts = torch.randint(0, vocab, (n,), generator=g, device=device)
    cu = torch.full((batch,), k, device=device).cumsum(0)
    argmax = torch.randint(0, vocab, (n,), generator=g, device=device)
    bonus = torch.randint(0, vocab, (batch,), generator=g, device=device)
    probs_vocab = min(vocab, 32000)
    p = torch.softmax(torch.randn(n, probs_vocab, generator=g, device=device), -1)
    q = torch.softmax(torch.randn(n, probs_vocab, generator=g, device=device), -1)
    drafts_p = drafts % probs_vocab
    exponential = torch.empty_like(p).exponential_(generator=g)
    uniform = torch.rand(n, generator=g, device=device)
    recovered = reference.sample_recovered(drafts_p, q, p, exponential)
    embeds = torch.randn(batch * 16, hidden, generator=g, device=device).to(torch.bfloat16)
    hidden_states = torch.randn(batch * 16, hidden, generator=g, device=device).to(torch.bfloat16)
    positions = torch.arange(batch * 16, device=device)
    norm = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    # A decode step's W4A16 and FP8 projections: `batch` tokens through a hidden x 4·hidden weight.
    tokens, outputs = batch, 4 * hidden
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    words = torch.randint(-(2**31), 2**31, (outputs, hidden // 8), generator=g, device=device).to(torch.int32)
    scales = torch.rand(outputs, hidden // 128, generator=g, device=device).to(torch.bfloat16) / 50
    fp8 = (torch.randn(outputs, hidden, generator=g, device=device) * 50).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(outputs // 128, hidden // 128, generator=g, device=device) / 50
    io = (x.numel() + tokens * outputs) * 2
    return [
        ("tensor_stats", f"{vocab}x{hidden} bf16", table.numel() * 2, "triton_stats", (table,)),
        (
            "row_fingerprints",
            f"64 rows of {vocab}x{hidden}",
            64 * hidden * 2,
            "triton_stats",
            (table, rows, projection),
        ),
        (
            "rejection_greedy",
            f"{batch} requests x k {k}",
            n * 8 * 2 + batch * 8 * (k + 2),
            "triton_verify",
            (drafts, cu, argmax, bonus, k),
        ),
        (
            "sample_recovered",
            f"{n} x {probs_vocab} probs",
            3 * p.numel() * 4,
            "triton_verify",
            (drafts_p, q, p, exponential),
        ),
        (
            "rejection_random",
            f"{batch} requests x k {k}",
            n * 8 * 4 + batch * 8 * (k + 2),
            "triton_verify",
            (drafts_p, cu, q, p, uniform, recovered, bonus, k),
        ),
        (
            "mtp_input",
            f"{batch * 16} x {hidden} bf16",
            embeds.numel() * 2 * 4,
            "triton_mtp",
            (embeds, hidden_states, positions, norm, norm, 1e-5),
        ),
        (
            "w4a16_matmul",
            f"{tokens} x {hidden} · int4 {outputs}x{hidden} g128",
            words.numel() * 4 + scales.numel() * 2 + io,
            "triton_quant",
            (x, words, scales, None, 128, "pack-quantized"),
        ),
        (
            "fp8_block_matmul",
            f"{tokens} x {hidden} · fp8 {outputs}x{hidden} 128x128",
            fp8.numel() + scale_inv.numel() * 4 + io,
            "triton_quant",
            (x, fp8, scale_inv, (128, 128)),
        ),
    ]


def compile_table() -> Table:
    """Every kernel compiled for sm_80 and sm_90 at real sizes (specdoctor.kernels.aot), with the shared
    memory Triton reports and the registers and spills ptxas reports: no GPU needed."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "specdoctor.kernels.aot", "--usage"]
    report = json.loads(subprocess.run(command, capture_output=True, text=True, env=env, check=True).stdout)
    table = Table(title="Compiled for the GPUs users run (triton.compile, GPUTarget cuda 80 / 90)")
    for column in ("kernel", "variant", "sm", "shared memory", "registers", "spills"):
        table.add_column(column, justify="left" if column in ("kernel", "variant") else "right")
    for row in report["compiled"]:
        table.add_row(row["kernel"], row["variant"], str(row["sm"]), f"{row['shared_bytes']:,} B",
                      str(row["registers"]), f"{row['spill_bytes']} B")  # fmt: skip
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    add_json_option(parser, "kernels")
    args = parser.parse_args()
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device, 256 if device.type == "cuda" else 64)
    use_triton = device.type == "cuda"
    table = Table(title=f"Kernels on {args.device} (copy bandwidth {bandwidth / 1e9:.1f} GB/s)")
    for column in ("kernel", "shape", "bytes", "torch ref", "triton", "floor", "triton / floor"):
        table.add_column(column, justify="right" if column not in ("kernel", "shape") else "left")
    rows = []
    for name, shape, nbytes, module, arguments in cases(device, args.vocab, args.hidden, args.batch, args.k):
        ref_s = timed(lambda: getattr(reference, name)(*arguments), device, args.repeats)  # noqa: B023
        triton_s = None
        if use_triton:
            kernel = getattr(__import__(f"specdoctor.kernels.{module}", fromlist=[name]), name)
            triton_s = timed(lambda: kernel(*arguments), device, args.repeats)  # noqa: B023
        floor = nbytes / bandwidth
        rows.append(
            {"kernel": name, "shape": shape, "bytes": nbytes, "torch_s": ref_s, "triton_s": triton_s, "floor_s": floor}
        )
        table.add_row(
            name,
            shape,
            f"{nbytes:,}",
            f"{ref_s * 1e6:,.0f} µs",
            f"{triton_s * 1e6:,.0f} µs" if triton_s else "n/a (CPU)",
            f"{floor * 1e6:,.1f} µs",
            f"{triton_s / floor:.1f}x" if triton_s else "-",
        )
    console = Console()
    console.print(table)
    if not use_triton:
        console.print(
            "On the CPU the runtime uses the torch reference (timed above); on a GPU this command also "
            "times the Triton kernels and their distance from the bandwidth floor."
        )
    console.print(compile_table())
    console.print(f"machine: {machine()}")
    write_json(args.json, {"bandwidth_bytes_per_s": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
