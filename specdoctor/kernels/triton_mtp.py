"""Triton: the MTP layer's input in one kernel: zero position-0 embeddings, enorm, hnorm, concatenate."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdoctor.kernels.buffers import output


@triton.jit
def _rms(x, weight_ptr, offs, mask, width, eps):
    """RMSNorm of one row in fp32: (normalised row, weight)."""
    variance = tl.sum(x * x, axis=0) / width
    return x * tl.rsqrt(variance + eps), tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _mtp_input_kernel(
    out_ptr, embeds_ptr, hidden_ptr, positions_ptr, enorm_ptr, hnorm_ptr, width, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    raw_embeds = tl.load(embeds_ptr + row * width + offs, mask=mask, other=0.0)
    raw_hidden = tl.load(hidden_ptr + row * width + offs, mask=mask, other=0.0)
    at_start = tl.load(positions_ptr + row) == 0
    embeds = tl.where(at_start, 0.0, raw_embeds.to(tl.float32))
    normed, weight = _rms(embeds, enorm_ptr, offs, mask, width, eps)
    # Round to the input dtype first, as torch does; the product itself is exact in fp32 then rounded.
    first = weight * normed.to(raw_embeds.dtype).to(tl.float32)
    normed, weight = _rms(raw_hidden.to(tl.float32), hnorm_ptr, offs, mask, width, eps)
    second = weight * normed.to(raw_hidden.dtype).to(tl.float32)
    base = out_ptr + row * 2 * width
    tl.store(base + offs, first.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(base + width + offs, second.to(out_ptr.dtype.element_ty), mask=mask)


def mtp_input(embeds, hidden, positions, enorm, hnorm, eps: float) -> torch.Tensor:
    width = embeds.shape[-1]
    dtype = torch.promote_types(enorm.dtype, embeds.dtype)
    out = output((*embeds.shape[:-1], 2 * width), dtype, embeds.device)
    rows = out.numel() // (2 * width) if width else 0
    if rows:
        _mtp_input_kernel[(rows,)](
            out,
            embeds.contiguous(),
            hidden.contiguous(),
            positions.contiguous(),
            enorm.contiguous(),
            hnorm.contiguous(),
            width,
            eps,
            BLOCK=triton.next_power_of_2(width),
        )
    return out
