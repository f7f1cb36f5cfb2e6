"""Triton: one pass over a tensor for the drafter statistics, and per-row norms and fingerprints."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdoctor.kernels.buffers import output
from specdoctor.kernels.reference import STAT_FIELDS

BLOCK = 4096  # counts per block stay exact in fp32 partials (< 2**24)


@triton.jit
def _stats_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    is_nan = mask & (x != x)
    is_pinf = mask & (x == float("inf"))
    is_ninf = mask & (x == float("-inf"))
    finite = mask & ~is_nan & ~is_pinf & ~is_ninf
    value = tl.where(finite, x, 0.0)
    out = partial_ptr + pid * 9
    tl.store(out + 0, tl.sum(is_nan.to(tl.float32), axis=0))
    tl.store(out + 1, tl.sum(is_pinf.to(tl.float32), axis=0))
    tl.store(out + 2, tl.sum(is_ninf.to(tl.float32), axis=0))
    tl.store(out + 3, tl.sum((mask & (x == 0)).to(tl.float32), axis=0))
    tl.store(out + 4, tl.sum(value, axis=0))
    tl.store(out + 5, tl.sum(value * value, axis=0))
    tl.store(out + 6, tl.min(tl.where(finite, x, float("inf")), axis=0))
    tl.store(out + 7, tl.max(tl.where(finite, x, float("-inf")), axis=0))
    tl.store(out + 8, tl.max(tl.where(finite, tl.abs(x), 0.0), axis=0))


def tensor_stats(x: torch.Tensor) -> dict[str, float]:
    flat = x.detach().reshape(-1)
    if flat.numel() == 0:
        from specdoctor.kernels.reference import tensor_stats as reference

        return reference(flat)
    blocks = triton.cdiv(flat.numel(), BLOCK)
    partial = output((blocks, 9), torch.float32, flat.device)
    _stats_kernel[(blocks,)](flat, partial, flat.numel(), BLOCK=BLOCK)
    counts = partial[:, :4].long().sum(0).tolist()
    sums = partial[:, 4:6].sum(0).tolist()  # fp32 partials, summed in fp32
    extremes = [partial[:, 6].min(), partial[:, 7].max(), partial[:, 8].max()]
    values = counts + sums + [float(v) for v in extremes]
    return {name: (int(v) if i < 4 else float(v)) for i, (name, v) in enumerate(zip(STAT_FIELDS, values, strict=True))}


@triton.jit
def _rows_kernel(x_ptr, rows_ptr, projection_ptr, norm_ptr, fingerprint_ptr, width, row_stride, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.load(rows_ptr + pid).to(tl.int64)
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    dots = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < width
        x = tl.load(x_ptr + row * row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.where((x == x) & (tl.abs(x) != float("inf")), x, 0.0)
        squares += x * x
        dots += x * tl.load(projection_ptr + offs, mask=mask, other=0.0)
    tl.store(norm_ptr + pid, tl.sqrt(tl.sum(squares, axis=0)))
    tl.store(fingerprint_ptr + pid, tl.sum(dots, axis=0))


def row_fingerprints(
    x: torch.Tensor, rows: torch.Tensor, projection: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x, rows = (x if x.stride(-1) == 1 else x.contiguous()), rows.contiguous()
    norms = output((rows.numel(),), torch.float32, x.device)
    fingerprints = output((rows.numel(),), torch.float32, x.device)
    if rows.numel():
        block = min(1024, triton.next_power_of_2(x.shape[1]))
        _rows_kernel[(rows.numel(),)](
            x, rows, projection.float().contiguous(), norms, fingerprints, x.shape[1], x.stride(0), BLOCK=block
        )
    return norms, fingerprints
