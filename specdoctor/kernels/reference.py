"""Plain-torch references of every kernel: the semantics, and the CPU production path.

Verification follows vLLM's rejection sampler: a batch of requests with different numbers of
draft tokens is flattened ([N] drafts, `cu_num_draft` the running end of each request's drafts);
outputs are [B, max_k + 1], padded with PLACEHOLDER.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PLACEHOLDER = -1
STAT_FIELDS = ("nan", "posinf", "neginf", "zeros", "sum", "sumsq", "min", "max", "absmax")


def tensor_stats(x: torch.Tensor) -> dict[str, float]:
    """Counts of NaN/+Inf/-Inf/zeros; sum, sum of squares, min, max, absmax of the finite values (fp32)."""
    values = x.detach().reshape(-1).float()
    finite = torch.isfinite(values)
    empty = not bool(finite.any())
    kept = torch.where(finite, values, 0.0)  # no compaction: one pass per statistic over the same buffer
    return {
        "nan": int(torch.isnan(values).sum()),
        "posinf": int((values == float("inf")).sum()),
        "neginf": int((values == float("-inf")).sum()),
        "zeros": int((values == 0).sum()),
        "sum": float(kept.sum()),
        "sumsq": float((kept * kept).sum()),
        "min": float("inf") if empty else float(torch.where(finite, values, float("inf")).min()),
        "max": float("-inf") if empty else float(torch.where(finite, values, float("-inf")).max()),
        "absmax": 0.0 if empty else float(kept.abs().max()),
    }


def row_fingerprints(
    x: torch.Tensor,  # [R, H]
    rows: torch.Tensor,  # [S] row indices to describe
    projection: torch.Tensor,  # [H] fp32: a fixed random direction
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2 norm [S], fingerprint [S]) of each selected row over its finite values; fingerprint = row · projection."""
    selected = x[rows].float()
    finite = torch.where(torch.isfinite(selected), selected, 0.0)
    return finite.pow(2).sum(-1).sqrt(), finite @ projection.float()


def _ragged(cu_num_draft: torch.Tensor, max_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat index [B, max_k] of each request's j-th draft, valid mask [B, max_k], draft counts [B])."""
    starts = torch.cat([cu_num_draft.new_zeros(1), cu_num_draft[:-1]])
    counts = cu_num_draft - starts
    j = torch.arange(max_k, device=cu_num_draft.device)
    return starts[:, None] + j, j < counts[:, None], counts


def _emit(accepted_ids, passed, index, counts, rejected_ids, bonus_ids, max_k) -> torch.Tensor:
    """Accepted drafts, then the rejected position's token (recovered) or, if none failed, the bonus token."""
    accepted = passed.long().cumprod(dim=1).sum(dim=1)  # [B]
    # One spare slot so gathers stay in range for empty batches and fully accepted rows.
    padded = torch.cat([accepted_ids, accepted_ids.new_full((1,), PLACEHOLDER)])
    spare = padded.numel() - 1
    tokens = padded[torch.where(passed, index, spare)]  # [B, max_k]
    out = torch.full((counts.shape[0], max_k + 1), PLACEHOLDER, dtype=torch.long, device=counts.device)
    out[:, :max_k] = torch.where(torch.arange(max_k, device=counts.device) < accepted[:, None], tokens, PLACEHOLDER)
    at = (index[:, :1].squeeze(1) if max_k else counts * 0) + accepted  # flat index of the first failure
    rejected = torch.cat([rejected_ids, rejected_ids.new_full((1,), PLACEHOLDER)])
    last = torch.where(accepted < counts, rejected[at.clamp(max=spare)], bonus_ids)
    return out.scatter(1, accepted[:, None], last[:, None].long())


def rejection_greedy(
    draft_ids: torch.Tensor,  # [N]
    cu_num_draft: torch.Tensor,  # [B] cumulative draft counts
    target_argmax: torch.Tensor,  # [N] target's argmax at each draft position
    bonus_ids: torch.Tensor,  # [B] target's argmax after the last draft
    max_k: int,
) -> torch.Tensor:  # [B, max_k + 1]
    """Accept drafts while they equal the target's argmax; then the recovered (first mismatch) or bonus token."""
    index, valid, counts = _ragged(cu_num_draft, max_k)
    safe = index.clamp(max=max(draft_ids.numel() - 1, 0))
    passed = valid & (draft_ids[safe] == target_argmax[safe]) if draft_ids.numel() else valid
    return _emit(draft_ids, passed, index, counts, target_argmax, bonus_ids, max_k)


def sample_recovered(
    draft_ids: torch.Tensor,  # [N]
    draft_probs: torch.Tensor,  # [N, V] q
    target_probs: torch.Tensor,  # [N, V] p
    exponential: torch.Tensor,  # [N, V] Exp(1) noise, drawn by the caller (no host synchronisation)
) -> torch.Tensor:  # [N]
    """A token per draft position from normalise(max(p - q, 0)) by the exponential race: argmax(r / E)."""
    residual = (target_probs.float() - draft_probs.float()).clamp_min(0)
    return (residual / exponential.float()).argmax(-1)


def rejection_random(
    draft_ids: torch.Tensor,  # [N]
    cu_num_draft: torch.Tensor,  # [B]
    draft_probs: torch.Tensor,  # [N, V] q
    target_probs: torch.Tensor,  # [N, V] p
    uniform: torch.Tensor,  # [N] u ~ U(0, 1)
    recovered_ids: torch.Tensor,  # [N] from sample_recovered
    bonus_ids: torch.Tensor,  # [B] sampled from the target after the last draft
    max_k: int,
) -> torch.Tensor:  # [B, max_k + 1]
    """Accept draft x when p(x) / q(x) >= u (q(x) > 0); on rejection emit the recovered token and stop."""
    index, valid, counts = _ragged(cu_num_draft, max_k)
    if draft_ids.numel():
        safe = index.clamp(max=draft_ids.numel() - 1)
        rows = torch.arange(draft_ids.numel(), device=draft_ids.device)
        p = target_probs[rows, draft_ids].float()
        q = draft_probs[rows, draft_ids].float()
        ok = (q > 0) & (p >= uniform.float() * q)  # p/q >= u without dividing
        passed = valid & ok[safe]
    else:
        passed = valid
    return _emit(draft_ids, passed, index, counts, recovered_ids, bonus_ids, max_k)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as GLM and DeepSeek compute it: normalise in fp32, cast back, then scale."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], weight, eps)  # the same arithmetic, one op
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def mtp_input(
    embeds: torch.Tensor,  # [..., H] drafter embeddings of the next tokens
    hidden: torch.Tensor,  # [..., H] previous hidden states
    positions: torch.Tensor,  # [...]
    enorm: torch.Tensor,  # [H]
    hnorm: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [..., 2H]
    """cat(enorm(embeds with position 0 zeroed), hnorm(hidden)): the MTP layer's input before eh_proj."""
    embeds = embeds.masked_fill((positions == 0)[..., None], 0.0)
    return torch.cat([rms_norm(embeds, enorm, eps), rms_norm(hidden, hnorm, eps)], dim=-1)


# Quantised weights (docs/quantization.md). Each dequantisation computes in fp32, where (q - zero) * scale
# is exact, and rounds once to the scales' dtype: what the formats' own tools produce.
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # AutoAWQ packs nibbles of 8 columns in the order 0 2 4 6 1 3 5 7


def unpack_int32(packed: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """Unsigned `bits`-bit values packed into int32 words along `dim`, value i of a word at bits i*bits
    (compressed-tensors' and AutoAWQ's word layout); the first `count` values along `dim`, as int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.movedim(dim, -1)
    values = ((words[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :count]
    return values.movedim(-1, dim)


def dequantize_pack_quantized(
    packed: torch.Tensor,  # [N, ceil(K * bits / 32)] int32
    scale: torch.Tensor,  # [N, G]
    zero_point: torch.Tensor | None,  # [ceil(N * bits / 32), G] int32, or None (symmetric)
    columns: int,  # K
    bits: int,
    group_size: int,  # columns per scale (K for per-channel scales)
    g_idx: torch.Tensor | None = None,  # [K]: the group of each column (activation ordering)
) -> torch.Tensor:  # [N, K] in scale's dtype
    """compressed-tensors `pack-quantized`: signed values stored with an offset of 2^(bits-1)."""
    rows, offset = packed.shape[0], 1 << (bits - 1)
    values = unpack_int32(packed, bits, columns, 1) - offset
    groups = g_idx.long() if g_idx is not None else torch.arange(columns, device=packed.device) // group_size
    zeros = 0 if zero_point is None else (unpack_int32(zero_point, bits, rows, 0) - offset)[:, groups]
    return ((values - zeros).float() * scale.float()[:, groups]).to(scale.dtype)


def dequantize_awq(
    qweight: torch.Tensor,  # [K, N / 8] int32
    qzeros: torch.Tensor,  # [K / group, N / 8] int32
    scales: torch.Tensor,  # [K / group, N]
    group_size: int,
) -> torch.Tensor:  # [N, K] (the nn.Linear layout) in scales' dtype
    """AutoAWQ GEMM, 4-bit: words packed along the output dimension in AWQ's interleaved order."""
    columns = qweight.shape[1] * 8
    order = (torch.arange(columns, device=qweight.device).view(-1, 8)[:, list(AWQ_REVERSE_ORDER)]).reshape(-1)
    values = unpack_int32(qweight, 4, columns, 1)[:, order]
    zeros = unpack_int32(qzeros, 4, columns, 1)[:, order].repeat_interleave(group_size, 0)[: values.shape[0]]
    scale = scales.float().repeat_interleave(group_size, 0)[: values.shape[0]]
    return ((values - zeros).float() * scale).to(scales.dtype).t()


def dequantize_fp8_block(
    weight: torch.Tensor,  # [N, K] float8
    scale_inv: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)]
    block: tuple[int, int],  # (bn, bk)
    dtype: torch.dtype,
) -> torch.Tensor:  # [N, K]
    """Block-scaled FP8 (DeepSeek-V3): each bn x bk block times its scale; edge blocks may be partial."""
    rows, columns = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :columns]
    return (weight.float() * scale).to(dtype)


def w4a16_matmul(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    packing: str,  # "pack-quantized" ([N, K/8], offset 8, optional zero points) or "awq" ([K, N/8], interleaved)
) -> torch.Tensor:  # [M, N] in x's dtype
    """x times the dequantised weight, transposed; the weight rounded to x's dtype as the runtime holds it."""
    if packing == "awq":
        weight = dequantize_awq(packed, zeros, scales, group_size)
    else:
        weight = dequantize_pack_quantized(packed, scales, zeros, x.shape[-1], 4, group_size)
    return (x.float() @ weight.to(x.dtype).float().t()).to(x.dtype)


def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """x [M, K] times the block-FP8 weight [N, K] dequantised to x's dtype, transposed: [M, N]."""
    return (x.float() @ dequantize_fp8_block(weight, scale_inv, block, x.dtype).float().t()).to(x.dtype)
