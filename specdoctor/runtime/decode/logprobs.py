"""Log-probabilities of the emitted tokens under the target's distribution, as vLLM reports them by default
(raw: log-softmax of the target's logits before temperature or top-p; docs/engine-semantics.md §Serving).
Only the last rank has the logits, so only it fills these; it is also the rank that reports to a server."""

from __future__ import annotations

import torch

# One emitted token: its log-probability and the `top` most likely tokens with theirs, best first.
TokenLogprob = tuple[float, list[tuple[int, float]]]
# One prompt token (from the second): its log-probability, its rank in the vocabulary (1: the likeliest), the top.
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


def emitted_logprobs(
    logits: torch.Tensor,  # [B, T, V] the target's logits at the positions that emitted tokens
    tokens: torch.Tensor,  # [B, T] the token emitted at each position (padding past a row's count)
    wanted: dict[int, int],  # row -> how many top alternatives that row asked for (0: only its own token)
) -> dict[int, list[TokenLogprob]]:
    """Per wanted row, an entry for each of its T positions (the caller keeps those it emitted)."""
    entries = {}
    for row, top in wanted.items():
        logprobs = logits[row].float().log_softmax(-1)  # [T, V]
        valid = tokens[row].clamp(0, logprobs.shape[-1] - 1)  # padding reads a real entry, then is dropped
        chosen = logprobs.gather(-1, valid[:, None])[:, 0].tolist()
        best = logprobs.topk(top, dim=-1) if top else None
        entries[row] = [
            (chosen[j], list(zip(best.indices[j].tolist(), best.values[j].tolist(), strict=True)) if best else [])
            for j in range(len(chosen))
        ]
    return entries


def prompt_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[PromptLogprob]:
    """One prompt's entries, as vLLM's `prompt_logprobs` reports them (raw): `logits` [T, V] at its positions 0 to
    T - 1, `tokens` [T] the prompt tokens 1 to T each position chose."""
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(-1, tokens[:, None])  # [T, 1]
    ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
    best = logprobs.topk(top, dim=-1) if top else None
    return [
        (value, rank, list(zip(best.indices[j].tolist(), best.values[j].tolist(), strict=True)) if best else [])
        for j, (value, rank) in enumerate(zip(chosen[:, 0].tolist(), ranks, strict=True))
    ]
