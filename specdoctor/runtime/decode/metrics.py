"""Speculative-decoding counters with vLLM's names and definitions (docs/engine-semantics.md §Metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    num_drafts: int = 0  # one per request per step that proposed drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, accepted: int, num_drafted: int, positions: int = 0) -> None:
        """One request's step: `num_drafted` drafts proposed, the first `accepted` of them accepted; the per-position
        counts reach at least `positions` (k, where a step verified fewer)."""
        width = max(num_drafted, positions)
        if len(self.num_accepted_tokens_per_pos) < width:
            self.num_accepted_tokens_per_pos += [0] * (width - len(self.num_accepted_tokens_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.num_accepted_tokens_per_pos[position] += 1

    def add(self, other: "SpecMetrics") -> None:
        """Accumulate another set of counters (e.g. one request's into the server's)."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        missing = len(other.num_accepted_tokens_per_pos) - len(self.num_accepted_tokens_per_pos)
        self.num_accepted_tokens_per_pos += [0] * max(0, missing)
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[position] += count

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: counts the bonus (or recovered) token each step emits."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_rates(self) -> list[float]:
        return [n / self.num_drafts if self.num_drafts else 0.0 for n in self.num_accepted_tokens_per_pos]

    def to_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance_rate": self.per_position_rates,
        }
