"""What a request asks of the target's logits before its token is chosen, greedy or sampled, as vLLM applies it
(docs/engine-semantics.md §Penalties): `logit_bias`, then `min_tokens` (the stop ids masked), then the repetition,
frequency and presence penalties, in float32. Under speculation each verified position is adjusted for the output
as if the drafts before it were accepted, so each accepted token is penalised as plain decoding penalises it; the
drafter's proposals are not adjusted (vLLM's are not either: only acceptance pays). Log-probabilities stay raw."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitAdjustments:
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, added to the logits
    min_tokens: int = 0  # the stop token ids are masked until the output has this many tokens
    repetition_penalty: float = 1.0  # on every token in the prompt or the output: logits > 0 divided, others times
    frequency_penalty: float = 0.0  # times each token's count in the output, subtracted
    presence_penalty: float = 0.0  # subtracted from every token in the output

    @property
    def active(self) -> bool:
        return self != LogitAdjustments()


def adjusted_logits(
    logits: torch.Tensor,  # [B, T, V]: position j chooses the token after the row's output and its first j drafts
    sequences: list,  # each row's SequenceRequest
    outputs: list[list[int]],  # each row's committed output tokens
    drafts: torch.Tensor | None,  # [B, T - 1] the drafts this step verifies (None: T is 1, a plain step)
    per_step: bool = False,  # --fault penalties-per-step: every position adjusted for the committed output alone
) -> torch.Tensor:
    """The logits a row's token is chosen from; the same tensor where no row asks for an adjustment."""
    rows = [row for row, sequence in enumerate(sequences) if sequence.adjustments.active]
    if not rows:
        return logits
    adjusted = logits.float().clone()
    drafted = drafts.tolist() if drafts is not None and not per_step else None
    for row in rows:
        follows = [outputs[row] + (drafted[row][:j] if drafted else []) for j in range(logits.shape[1])]
        adjust_row(adjusted[row], sequences[row], follows)
    return adjusted


def adjust_row(logits: torch.Tensor, sequence, follows: list[list[int]]) -> None:
    """In place, logits [T, V]: position j after the output `follows[j]`."""
    wanted, device, vocab = sequence.adjustments, logits.device, logits.shape[-1]
    if wanted.logit_bias:
        ids, biases = zip(*wanted.logit_bias, strict=True)
        logits[:, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=device)
    short = [j for j, output in enumerate(follows) if len(output) < wanted.min_tokens]
    if short and sequence.stop_token_ids:
        logits[torch.tensor(short, device=device)[:, None], torch.tensor(sequence.stop_token_ids, device=device)] = (
            float("-inf")
        )
    seen = [torch.tensor(output, dtype=torch.long, device=device) for output in follows]
    counts = torch.stack([torch.bincount(output, minlength=vocab) for output in seen]).to(logits.dtype)  # [T, V]
    if wanted.repetition_penalty != 1.0:
        prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt[torch.tensor(sequence.prompt, device=device)] = True
        penalties = torch.where((counts > 0) | prompt, wanted.repetition_penalty, 1.0)
        logits *= torch.where(logits > 0, 1.0 / penalties, penalties)
    logits -= wanted.frequency_penalty * counts
    logits -= wanted.presence_penalty * (counts > 0).to(logits.dtype)
