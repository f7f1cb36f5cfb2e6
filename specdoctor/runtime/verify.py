"""Verification of draft tokens against the target (vLLM's semantics, DESIGN.md §2).

Vocabulary: p is the target's distribution, q the drafter's. Draft j is *accepted* while it
passes; at the first failure the target emits a *recovered* token instead and the step ends;
if all k drafts pass, the target's distribution after the last draft gives a *bonus* token.
Either way a step emits accepted + 1 tokens. Output rows are padded with PLACEHOLDER.
"""

from __future__ import annotations

import torch

PLACEHOLDER = -1


def _emit(accepted: torch.Tensor, drafts: torch.Tensor, last_token: torch.Tensor) -> torch.Tensor:
    """Row b: drafts[b, :n] then last_token[b] at index n, then placeholders ([B, k+1])."""
    batch, k = drafts.shape
    index = torch.arange(k + 1, device=drafts.device)
    padded = torch.cat([drafts, torch.full((batch, 1), PLACEHOLDER, device=drafts.device)], dim=1)
    out = torch.where(index < accepted[:, None], padded, PLACEHOLDER)
    return out.scatter(1, accepted[:, None], last_token[:, None])


def verify_greedy(
    drafts: torch.Tensor,  # [B, k] proposed tokens
    target_logits: torch.Tensor,  # [B, k+1, V] target logits at the pending token and each draft
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted counts [B], emitted tokens [B, k+1]): accept while the draft is the target's argmax."""
    argmax = target_logits.argmax(-1)  # [B, k+1]
    matches = (drafts == argmax[:, :-1]).long()
    accepted = matches.cumprod(dim=1).sum(dim=1)
    # Recovered (first mismatch) or bonus (all matched): the target's argmax at index n.
    return accepted, _emit(accepted, drafts, argmax.gather(1, accepted[:, None]).squeeze(1))


def verify_random(
    drafts: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor,  # [B, k, V] q: the distributions the drafts were sampled from
    target_probs: torch.Tensor,  # [B, k+1, V] p
    uniform: torch.Tensor,  # [B, k] u ~ U(0, 1), one per draft
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling: accept draft x when p(x) / q(x) >= u, which keeps the output distributed as p."""
    batch, k = drafts.shape
    p_draft = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(-1)
    q_draft = draft_probs.gather(2, drafts[..., None]).squeeze(-1)
    passed = (p_draft >= uniform * q_draft).long()  # p/q >= u without dividing by a zero q
    accepted = passed.cumprod(dim=1).sum(dim=1)
    # At the first rejection sample from normalise(max(p - q, 0)); after k acceptances, from p.
    q_padded = torch.cat([draft_probs, torch.zeros_like(target_probs[:, :1])], dim=1)
    index = accepted[:, None, None].expand(-1, 1, target_probs.shape[-1])
    residual = (target_probs.gather(1, index) - q_padded.gather(1, index)).clamp_min(0).squeeze(1)
    mass = residual.sum(-1, keepdim=True)
    # p == q leaves no residual mass; then any token is as good as p itself.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target_probs.gather(1, index).squeeze(1))
    last = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return accepted, _emit(accepted, drafts, last)
