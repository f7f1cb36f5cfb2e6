"""Verification of draft tokens against the target (vLLM's semantics, docs/engine-semantics.md §Verification).

Vocabulary: p is the target's distribution, q the drafter's. Draft j is *accepted* while it
passes; at the first failure the target emits a *recovered* token instead and the step ends;
if all k drafts pass, the target's distribution after the last draft gives a *bonus* token.
Either way a step emits accepted + 1 tokens. Output rows are padded with PLACEHOLDER.
The work is done by `specdoctor.kernels` (Triton on CUDA, the torch reference on CPU).
"""

from __future__ import annotations

import torch

from specdoctor import kernels
from specdoctor.kernels.reference import PLACEHOLDER
from specdoctor.runtime.sampling import greedy_tokens

__all__ = ["PLACEHOLDER", "verify_greedy", "verify_random"]


def _flat(drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [B, k] batch as the kernels' ragged form: drafts [B*k] and cumulative counts [B]."""
    batch, k = drafts.shape
    return drafts.reshape(-1), torch.arange(1, batch + 1, device=drafts.device) * k


def _accepted(emitted: torch.Tensor) -> torch.Tensor:
    return (emitted != PLACEHOLDER).sum(dim=1) - 1


def verify_greedy(
    drafts: torch.Tensor,  # [B, k] proposed tokens
    target_logits: torch.Tensor,  # [B, k+1, V] target logits at the pending token and each draft
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted counts [B], emitted tokens [B, k+1]): accept while the draft is the target's argmax."""
    k = drafts.shape[1]
    argmax = greedy_tokens(target_logits)  # [B, k+1]
    if k == 0:  # plain decoding: the step's one token is the target's argmax
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=drafts.device), argmax
    flat, cu = _flat(drafts)
    emitted = kernels.rejection_greedy(flat, cu, argmax[:, :k].reshape(-1), argmax[:, k], k)
    return _accepted(emitted), emitted


def verify_random(
    drafts: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor,  # [B, k, V] q: the distributions the drafts were sampled from
    target_probs: torch.Tensor,  # [B, k+1, V] p
    uniform: torch.Tensor,  # [B, k] u ~ U(0, 1), one per draft
    generator: torch.Generator | None,
    reuse_uniform: bool = False,  # --fault rejection-reuse-uniform (runtime/faults.py)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling: accept draft x when p(x) / q(x) >= u, which keeps the output distributed as p."""
    batch, k = drafts.shape
    vocab = target_probs.shape[-1]
    flat, cu = _flat(drafts)
    q = draft_probs.reshape(-1, vocab)
    p = target_probs[:, :k].reshape(-1, vocab)
    # Noise drawn up front, so the kernels need no host synchronisation.
    if reuse_uniform:  # one number for every candidate: the race is won by the residual's largest entry
        exponential = (-uniform.reshape(-1, 1).clamp(min=1e-12).log()).expand_as(p).contiguous()
    else:
        exponential = torch.empty_like(p).exponential_(generator=generator)
    recovered = kernels.sample_recovered(flat, q, p, exponential)
    bonus = torch.multinomial(target_probs[:, k], 1, generator=generator).squeeze(1)
    emitted = kernels.rejection_random(flat, cu, q, p, uniform.reshape(-1), recovered, bonus, k)
    return _accepted(emitted), emitted
