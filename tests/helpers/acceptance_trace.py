"""Draft acceptance measured offline on a greedy trace.

On a greedy trace the target's argmax at every position is the next token, so one forward pass
over prompt + continuation tells exactly which first drafts k=1 speculative decoding accepts.
Used to train and measure the demo model.
"""

from __future__ import annotations

import torch

from specdoctor.runtime.models.dspark import DSparkDrafter
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


def traced(target: TargetStage, prompts: list[list[int]], new_tokens: int, entries: tuple[int, ...]):
    """Per prompt: (the prompt, prompt + its greedy continuation [L], positions [1, L], the taps at `entries`
    [1, L, taps, H]), from one forward pass of the target over the whole trace."""
    for prompt, continuation in zip(prompts, greedy_generate(target, prompts, new_tokens), strict=True):
        sequence = torch.tensor(prompt + continuation)
        positions = torch.arange(len(sequence))[None]
        _, captured = target.forward_with_taps(sequence[None], positions)
        yield prompt, sequence, positions, torch.stack([captured[entry] for entry in entries], dim=2)


@torch.no_grad()
def block_acceptance(
    target: TargetStage, drafter: DSparkDrafter, prompts: list[list[int]], new_tokens: int, k: int
) -> list[float]:
    """Per-position acceptance rates of a DSpark drafter's greedy block of k drafts anchored at every position
    of each greedy continuation: the share of anchors whose first i + 1 drafts all equal the trace. Drafted
    through the runtime's own context and block passes, every anchor a row with the whole context cached."""
    accepted, anchors = torch.zeros(k), 0
    for prompt, sequence, positions, taps in traced(target, prompts, new_tokens, drafter.config.tap_entries):
        length = len(sequence)
        starts = torch.arange(len(prompt), length - k)  # each anchor's position: the trace continues k tokens
        rows = len(starts)
        cache = drafter.new_cache(rows, length + k, taps.dtype, taps.device)
        drafter.write_context(taps.expand(rows, -1, -1, -1), positions.expand(rows, -1), cache)
        next_tokens = sequence[starts][:, None]  # the anchor, at index 0 of each row's "new positions"
        chain = drafter.draft_block(next_tokens[:, 0], (starts - 1), cache, k)
        logits = next(chain)
        drafts = []
        for step in range(k):
            drafts.append(logits.argmax(-1))
            if step + 1 < k:
                logits = chain.send(drafts[-1])
        drafts = torch.stack(drafts, 1)  # [rows, k]
        truth = sequence[starts[:, None] + 1 + torch.arange(k)]
        accepted += (drafts == truth).int().cumprod(1).sum(0).float()
        anchors += rows
    return (accepted / max(anchors, 1)).tolist()


@torch.no_grad()
def chain_acceptance(target: TargetStage, drafter, prompts: list[list[int]], new_tokens: int, k: int) -> list[float]:
    """Per-position acceptance rates of a chain drafter reading taps (EAGLE-3) over each greedy continuation: from
    every position of it, k greedy drafts through the drafter's own `draft` (step 0 over the whole sequence, then
    the chain from that position), the share whose first i + 1 drafts all equal the trace."""
    accepted, bases = torch.zeros(k), 0
    for prompt, sequence, positions, taps in traced(target, prompts, new_tokens, target.tap_entries):
        length = len(sequence)
        starts = torch.arange(len(prompt) - 1, length - k - 1)  # the trace continues k + 1 tokens after each
        rows = len(starts)
        cache = drafter.new_cache(rows, length + k, taps.dtype, taps.device)
        next_tokens = torch.cat([sequence[1:], sequence.new_zeros(1)])[None].expand(rows, -1)
        chain = drafter.draft(next_tokens, taps.expand(rows, -1, -1, -1), positions.expand(rows, -1), starts, cache, k)
        drafts = [next(chain).argmax(-1)]
        for _ in range(k - 1):
            drafts.append(chain.send(drafts[-1]).argmax(-1))
        truth = sequence[starts[:, None] + 2 + torch.arange(k)]
        accepted += (torch.stack(drafts, 1) == truth).int().cumprod(1).sum(0).float()
        bases += rows
    return (accepted / max(bases, 1)).tolist()
