"""Triton: speculative verification for a batch of requests with different numbers of drafts
(vLLM's semantics: accepted drafts, then a recovered or bonus token, padded with PLACEHOLDER)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdoctor.kernels.buffers import output
from specdoctor.kernels.reference import PLACEHOLDER


@triton.jit
def _finish(out_ptr, b, j, first, count, accepted_tokens, rejected_token, bonus_ptr, max_k, PLACEHOLDER: tl.constexpr):
    """Write row b: tokens before `first`, then the rejected position's token or the bonus, then padding."""
    last = tl.where(first < count, rejected_token, tl.load(bonus_ptr + b))
    out = tl.where(j < first, accepted_tokens, PLACEHOLDER)
    out = tl.where(j == first, last, out)
    tl.store(out_ptr + b * (max_k + 1) + j, out, mask=j <= max_k)


@triton.jit
def _greedy_kernel(
    out_ptr, cu_ptr, draft_ptr, target_ptr, bonus_ptr, max_k, BLOCK_K: tl.constexpr, PLACEHOLDER: tl.constexpr
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b - 1, mask=b > 0, other=0)
    count = tl.load(cu_ptr + b) - start
    j = tl.arange(0, BLOCK_K)
    valid = j < count
    draft = tl.load(draft_ptr + start + j, mask=valid, other=PLACEHOLDER)
    target = tl.load(target_ptr + start + j, mask=valid, other=PLACEHOLDER)
    first = tl.min(tl.where(valid & (draft != target), j, count), axis=0)  # accepted count
    recovered = tl.sum(tl.where(j == first, target, 0), axis=0)
    _finish(out_ptr, b, j, first, count, target, recovered, bonus_ptr, max_k, PLACEHOLDER)


@triton.jit
def _random_kernel(
    out_ptr,
    cu_ptr,
    draft_ptr,
    draft_probs_ptr,
    target_probs_ptr,
    uniform_ptr,
    recovered_ptr,
    bonus_ptr,
    vocab,
    max_k,
    BLOCK_K: tl.constexpr,
    PLACEHOLDER: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b - 1, mask=b > 0, other=0)
    count = tl.load(cu_ptr + b) - start
    j = tl.arange(0, BLOCK_K)
    valid = j < count
    index = (start + j).to(tl.int64)
    draft = tl.load(draft_ptr + index, mask=valid, other=0)
    p = tl.load(target_probs_ptr + index * vocab + draft, mask=valid, other=0.0).to(tl.float32)
    q = tl.load(draft_probs_ptr + index * vocab + draft, mask=valid, other=0.0).to(tl.float32)
    u = tl.load(uniform_ptr + index, mask=valid, other=1.0).to(tl.float32)
    accepted = (q > 0) & (p >= u * q)
    first = tl.min(tl.where(valid & ~accepted, j, count), axis=0)
    recovered = tl.sum(tl.where(j == first, tl.load(recovered_ptr + index, mask=valid, other=0), 0), axis=0)
    _finish(out_ptr, b, j, first, count, draft, recovered, bonus_ptr, max_k, PLACEHOLDER)


@triton.jit
def _recovered_kernel(out_ptr, draft_probs_ptr, target_probs_ptr, exponential_ptr, vocab, BLOCK_V: tl.constexpr):
    """argmax over v of max(p - q, 0) / E: a sample from normalise(max(p - q, 0)) (exponential race)."""
    i = tl.program_id(0).to(tl.int64)
    best = tl.full((), -1.0, tl.float32)
    best_index = tl.full((), 0, tl.int64)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < vocab
        p = tl.load(target_probs_ptr + i * vocab + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(draft_probs_ptr + i * vocab + offs, mask=mask, other=0.0).to(tl.float32)
        e = tl.load(exponential_ptr + i * vocab + offs, mask=mask, other=1.0).to(tl.float32)
        score = tl.where(mask, tl.maximum(p - q, 0.0) / e, -1.0)
        block_best = tl.max(score, axis=0)
        block_index = tl.argmax(score, axis=0).to(tl.int64) + start
        better = block_best > best
        best_index = tl.where(better, block_index, best_index)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + i, best_index)


def _output(cu_num_draft: torch.Tensor, max_k: int) -> torch.Tensor:
    return output((cu_num_draft.shape[0], max_k + 1), torch.long, cu_num_draft.device)


def _contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels index flat memory: strided views (such as argmax[:, k]) must be copied first."""
    return [t.contiguous() for t in tensors]


def rejection_greedy(draft_ids, cu_num_draft, target_argmax, bonus_ids, max_k: int) -> torch.Tensor:
    inputs = _contiguous(cu_num_draft, draft_ids, target_argmax, bonus_ids)
    out = _output(cu_num_draft, max_k)
    if out.shape[0]:
        block = triton.next_power_of_2(max_k + 1)
        _greedy_kernel[(out.shape[0],)](out, *inputs, max_k, BLOCK_K=block, PLACEHOLDER=PLACEHOLDER)
    return out


def rejection_random(
    draft_ids, cu_num_draft, draft_probs, target_probs, uniform, recovered_ids, bonus_ids, max_k: int
) -> torch.Tensor:
    inputs = _contiguous(cu_num_draft, draft_ids, draft_probs, target_probs, uniform, recovered_ids, bonus_ids)
    out = _output(cu_num_draft, max_k)
    if out.shape[0]:
        vocab = target_probs.shape[-1] if target_probs.numel() else 1
        block = triton.next_power_of_2(max_k + 1)
        _random_kernel[(out.shape[0],)](out, *inputs, vocab, max_k, BLOCK_K=block, PLACEHOLDER=PLACEHOLDER)
    return out


def sample_recovered(draft_ids, draft_probs, target_probs, exponential) -> torch.Tensor:
    out = output((draft_ids.shape[0],), torch.long, draft_ids.device)
    if out.numel():
        vocab = target_probs.shape[-1]
        block = min(1024, triton.next_power_of_2(vocab))
        _recovered_kernel[(out.numel(),)](
            out, *_contiguous(draft_probs, target_probs, exponential), vocab, BLOCK_V=block
        )
    return out
