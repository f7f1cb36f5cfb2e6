"""The tests `probe`'s sweeps decide with (docs/probe.md §Thresholds): each has a stated false-positive rate.

ALPHA is the family-wise false-positive rate of one sweep: a sweep that compares several groups with its
reference splits it between them (Bonferroni).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

ALPHA = 0.001


def drop_p_value(reference: tuple[int, int], group: tuple[int, int]) -> float:
    """One-sided p-value that `group` accepts less often than `reference`, each (accepted, drafts): the pooled
    two-proportion z test. 1.0 where either has no drafts or nothing varies."""
    (x1, n1), (x2, n2) = reference, group
    if not n1 or not n2:
        return 1.0
    pooled = (x1 + x2) / (n1 + n2)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    if spread == 0:
        return 1.0
    return 1 - NormalDist().cdf((x1 / n1 - x2 / n2) / spread)


def rate_upper_bound(accepted: int, drafts: int, alpha: float) -> float:
    """Wilson's one-sided upper confidence bound on a rate at level 1 - alpha."""
    if not drafts:
        return 1.0
    z = NormalDist().inv_cdf(1 - alpha)
    rate = accepted / drafts
    centre = rate + z * z / (2 * drafts)
    margin = z * math.sqrt(rate * (1 - rate) / drafts + z * z / (4 * drafts * drafts))
    return min(1.0, (centre + margin) / (1 + z * z / drafts))


def calibration_p_value(probabilities: list[list[float]], outcomes: list[int]) -> tuple[float, float, int]:
    """Are outcomes distributed as stated? Step t put probabilities[t] on its bins (they sum to 1) and landed in
    bin outcomes[t]. The counts minus their expectations, D = sum(o_t - p_t), have covariance
    S = sum(diag p_t - p_t p_t^T); D^T S^-1 D (on all bins but the last) is chi-square with bins - 1 degrees of
    freedom for any mix of step distributions. Returns (statistic, p-value, degrees of freedom)."""
    p = torch.tensor(probabilities, dtype=torch.float64)[:, :-1]  # the last bin is the rest: dependent
    observed = torch.nn.functional.one_hot(torch.tensor(outcomes), p.shape[1] + 1).to(torch.float64)[:, :-1]
    difference = (observed - p).sum(0)
    covariance = torch.diag(p.sum(0)) - p.T @ p
    statistic = float(difference @ torch.linalg.pinv(covariance, hermitian=True) @ difference)
    df = int(torch.linalg.matrix_rank(covariance, hermitian=True))
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(statistic / 2))) if df else 1.0
    return statistic, p_value, df
