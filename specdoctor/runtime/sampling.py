"""Sampling parameters and the probability processing shared by target and drafter."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdoctor.errors import SpecdoctorError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise SpecdoctorError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SpecdoctorError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecdoctorError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded(self) -> bool:
        """Sampling with a seed: the same tokens whatever batch the request shares (adaptive speculation keeps it)."""
        return not self.greedy and self.seed is not None


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax after temperature, top-k and top-p, over the last dimension ([..., V] -> [..., V])."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension (the first index on ties, as argmax gives), through `max`: on the CPU
    its kernel is three to five times faster than argmax's over a vocabulary (docs/runtime.md: `--compile`)."""
    return logits.max(-1).indices


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs ([N, V] -> [N])."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class RowSampler:
    """Each row's sampling parameters and its own generator: a seeded row draws the same numbers, in the
    same order, whatever else shares its batch (so it reproduces its output when run alone)."""

    def __init__(self, params: list[SamplingParams], device: torch.device, generators=None):
        self.params = params
        self.generators = (
            generators if generators is not None else [None if p.greedy else _seeded(p.seed, device) for p in params]
        )

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def sampled_rows(self) -> list[int]:
        return [row for row, p in enumerate(self.params) if not p.greedy]

    @staticmethod
    def join(samplers: list["RowSampler"], rows: list[int] | None = None) -> "RowSampler":
        """The rows of these samplers, concatenated in order, then `rows` of them (None: all)."""
        params = [p for sampler in samplers for p in sampler.params]
        generators = [g for sampler in samplers for g in sampler.generators]
        rows = range(len(params)) if rows is None else rows
        return RowSampler([params[r] for r in rows], None, [generators[r] for r in rows])


def _seeded(seed: int | None, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    # An unseeded row draws its seed from the process's generator, which every rank seeds alike at start (the TP
    # ranks of the last stage sample alike, so their drafters stay in step: runtime/rank_loading.py).
    generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ())))
    return generator
