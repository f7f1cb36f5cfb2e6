"""Draft acceptance measured offline on a greedy trace.

On a greedy trace the target's argmax at every position is the next token, so one forward pass
over prompt + continuation tells exactly which first drafts k=1 speculative decoding accepts.
Used to train and measure the demo model.
"""

from __future__ import annotations

import torch

from specdoctor.runtime.models.mtp import MtpDrafter
from specdoctor.runtime.models.stage import TargetStage
from tests.helpers.reference_decoder import greedy_generate


@torch.no_grad()
def position0_acceptance(target: TargetStage, drafter: MtpDrafter, prompts: list[list[int]], new_tokens: int) -> float:
    """Share of greedy steps after each prompt where the MTP's first draft equals the target's token."""
    continuations = greedy_generate(target, prompts, new_tokens)
    hits = total = 0
    for prompt, continuation in zip(prompts, continuations, strict=True):
        sequence = torch.tensor(prompt + continuation)[None]  # [1, L]
        positions = torch.arange(sequence.shape[1])[None]
        hidden = target.head(target(sequence, positions))[0]  # the drafter sees the final-normed state
        # Draft at index i sees the target's hidden state at i and token i+1; it guesses token i+2.
        _, logits = drafter(sequence[:, 1:], hidden[:, :-1], positions[:, :-1])
        first = len(prompt) - 1
        drafts = logits.argmax(-1)[0, first : sequence.shape[1] - 2]
        hits += int((drafts == sequence[0, first + 2 :]).sum())
        total += drafts.numel()
    return hits / max(total, 1)
