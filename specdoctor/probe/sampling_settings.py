"""The sampling settings users send (temperature, top-p, top-k), and what the server's reported top
log-probabilities say each sampled token's rank should follow under one of them (docs/probe.md §Sampling).

Servers report the raw distribution (vLLM's default logprobs mode: before temperature and truncation), and only its
top few tokens. At temperature T each token's weight is p^(1/T). The unreported tail's weight is known exactly at
T = 1 (one minus the reported mass), and bounded above at T < 1 (every tail token is at most as likely as the last
reported one). A top-p nucleus that ends inside the reported tokens for every tail weight in those bounds, or a top-k
of at most the reported tokens, fixes the distribution over ranks exactly. A step where the unreported tail could
move the nucleus's edge is left out, and that choice depends on the prefix alone, never on the token sampled, so it
biases nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdoctor.errors import SpecdoctorError

# A nucleus edge closer than this to top-p is left undecided: the reported log-probabilities are float32, rounded
# again on the way, and the server's own cumulative sum runs in its compute dtype.
EDGE_MARGIN = 1e-4


@dataclass(frozen=True)
class SamplingSetting:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut

    @property
    def label(self) -> str:
        parts = [f"temperature {self.temperature:g}"]
        parts += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
        parts += [f"top-k {self.top_k}"] if self.top_k else []
        return ", ".join(parts)


# Temperature 1 (the distribution as reported), and the chat defaults most traffic runs at.
DEFAULT_SETTINGS = "1,0.6:0.95,0.8:0.95"


def parse_settings(text: str) -> tuple[SamplingSetting, ...]:
    """`T[:top_p[:top_k]]`, comma-separated, e.g. `1,0.6:0.95,0.7:1:40`."""
    settings = []
    for item in text.split(","):
        fields = item.strip().split(":")
        try:
            temperature = float(fields[0])
            top_p = float(fields[1]) if len(fields) > 1 else 1.0
            top_k = int(fields[2]) if len(fields) > 2 else 0
        except ValueError:
            temperature = top_p = top_k = -1
        if len(fields) > 3 or not 0 < temperature <= 2 or not 0 < top_p <= 1 or top_k < 0:
            raise SpecdoctorError(
                f"--sampling-settings {text!r}: each setting is TEMPERATURE[:TOP_P[:TOP_K]] with temperature in "
                "(0, 2], top-p in (0, 1] and top-k >= 0, e.g. 1,0.6:0.95"
            )
        settings.append(SamplingSetting(temperature, top_p, top_k))
    return tuple(settings)


def rank_probabilities(ranked: list[float], setting: SamplingSetting) -> list[float] | None:
    """From one step's reported raw log-probabilities, highest first: the probability under `setting` of each
    reported rank, then of every other token (a list one longer than `ranked`); None where the unreported tail
    leaves it undetermined."""
    n = len(ranked)
    raw = [math.exp(value) for value in ranked]
    rest = max(0.0, 1.0 - sum(raw))
    power = 1.0 / setting.temperature
    weights = [math.exp((value - ranked[0]) * power) for value in ranked]  # relative to the top token's
    cut = setting.top_k if 0 < setting.top_k <= n else n
    weights = weights[:cut]
    tail_scale = raw[0] ** power
    if cut < n or rest == 0:
        tail = (0.0, 0.0)  # top-k within the reported tokens: nothing else can be drawn
    elif setting.temperature == 1:
        tail = (0.0, rest / raw[0]) if setting.top_k else (rest / raw[0], rest / raw[0])
    elif setting.temperature < 1:
        tail = (0.0, rest * raw[-1] ** (power - 1) / tail_scale)  # each tail token at most as likely as the last
    else:
        return None  # above 1 the tail's weight has no bound without the vocabulary
    total = sum(weights)
    if setting.top_p >= 1:
        if tail[0] != tail[1]:
            return None
        whole = total + tail[0]
        return [w / whole for w in weights] + [0.0] * (n - cut) + [tail[0] / whole]
    nucleus = nucleus_size(weights, tail, setting.top_p)
    if nucleus is None:
        return None
    kept = sum(weights[:nucleus])
    return [w / kept for w in weights[:nucleus]] + [0.0] * (n - nucleus) + [0.0]


def nucleus_size(weights: list[float], tail: tuple[float, float], top_p: float) -> int | None:
    """The smallest number of leading tokens whose mass reaches top_p, the same for every tail weight in
    [tail[0], tail[1]] (with EDGE_MARGIN to spare); None where the tail could change it."""
    total, before = sum(weights), 0.0
    for size, weight in enumerate(weights, start=1):
        mass = before + weight
        reached_surely = mass / (total + tail[1]) >= top_p + EDGE_MARGIN
        not_reached_before = before / (total + tail[0]) < top_p - EDGE_MARGIN
        if reached_surely:
            return size if not_reached_before else None
        if mass / (total + tail[0]) >= top_p - EDGE_MARGIN:
            return None  # this prefix may or may not reach it
        before = mass
    return None


def merge_sparse_bins(
    probabilities: list[list[float]], outcomes: list[int], min_expected: float
) -> tuple[list[list[float]], list[int]] | None:
    """The trailing bins folded into the one before them until every bin expects at least `min_expected` tokens
    (the chi-square approximation's condition); None when fewer than two bins are left."""
    width = len(probabilities[0]) if probabilities else 0
    while width >= 2:
        expected = [sum(row[b] for row in probabilities) for b in range(width)]
        if min(expected) >= min_expected:
            return probabilities, outcomes
        probabilities = [[*row[: width - 2], row[width - 2] + row[width - 1]] for row in probabilities]
        outcomes = [min(outcome, width - 2) for outcome in outcomes]
        width -= 1
    return None
