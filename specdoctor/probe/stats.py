"""The tests `probe`'s sweeps decide with (docs/probe.md §Thresholds): each has a stated false-positive rate.

A sweep's family-wise false-positive rate (options.ALPHA, or probe --alpha) is split between the groups it
compares with its reference (Bonferroni).

Acceptance is compared with the request as the unit: a request's drafts are correlated (one text, one
trajectory: measured dispersion 1.4), so each rate's variance is the cluster-robust one of a ratio estimator
over requests, and a test's reference distribution is Student's t on the requests' degrees of freedom.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch

Unit = tuple[int, int]  # one request's (or one wave of concurrent requests') position-0 acceptances and drafts
POWER = 0.9  # the power a sweep's size is chosen for
MAX_PROMPTS = 1000  # prompts_for_power's answer past this: more than any sweep sends


def student_t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with `df` degrees of freedom (the normal's where df is infinite)."""
    if math.isinf(df):
        return 1 - NormalDist().cdf(t)
    tail = 0.5 * incomplete_beta(df / 2, 0.5, df / (df + t * t))
    return tail if t > 0 else 1 - tail


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast on this side only
        return 1 - incomplete_beta(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            numerator = 1.0
        elif i % 2 == 0:
            numerator = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            numerator = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + numerator * d
        d = 1 / (d if abs(d) > tiny else tiny)
        c = 1 + numerator / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1 - c * d) < 1e-14:
            break
    return front * (f - 1)


def rate_and_variance(units: list[Unit]) -> tuple[float, float]:
    """The pooled rate (all acceptances over all drafts) and its variance with the request as the unit: the
    linearised ratio estimator's, m/(m-1) sum((x_i - p n_i) / N)^2, never under the binomial p(1-p)/N, p taken
    half an acceptance in from 0 and 1 (a single request, or every request at a rate of 0 or 1, says nothing of
    the spread)."""
    accepted, drafts = sum(x for x, _ in units), sum(n for _, n in units)
    if not drafts:
        return 0.0, 0.0
    rate, m = accepted / drafts, len(units)
    centred = (accepted + 0.5) / (drafts + 1)  # a rate of 0 or 1 is no proof of zero variance
    binomial = centred * (1 - centred) / drafts
    if m < 2:
        return rate, binomial
    clustered = m / (m - 1) * sum(((x - rate * n) / drafts) ** 2 for x, n in units)
    return rate, max(clustered, binomial)


def fall_p_value(reference: list[Unit], group: list[Unit], keep: float = 1.0, paired: bool = False) -> float:
    """One-sided p-value that `group`'s rate is under `keep` x `reference`'s (1: any fall). `paired`: unit i of
    each is the same prompt (its difference's variance is then the pairs'); else the two are independent
    (Welch's degrees of freedom). 1.0 where either has no drafts."""
    (rate_r, var_r), (rate_g, var_g) = rate_and_variance(reference), rate_and_variance(group)
    drafts_r, drafts_g = sum(n for _, n in reference), sum(n for _, n in group)
    if not drafts_r or not drafts_g:
        return 1.0
    fall, variance = keep * rate_r - rate_g, 0.0
    if paired and len(reference) == len(group) > 1:
        m = len(group)
        pairs = [
            (xg - rate_g * ng) / drafts_g - keep * (xr - rate_r * nr) / drafts_r
            for (xr, nr), (xg, ng) in zip(reference, group, strict=True)
        ]
        variance, df = m / (m - 1) * sum(u * u for u in pairs), m - 1
    if variance <= 0:  # unpaired, or pairs that vary not at all (they say nothing of the spread)
        parts = [(keep * keep * var_r, len(reference)), (var_g, len(group))]
        variance = sum(v for v, _ in parts)
        welch = sum(v * v / (m - 1) for v, m in parts if m > 1 and v > 0)
        df = variance * variance / welch if welch and all(m > 1 for _, m in parts) else math.inf
    if variance <= 0:
        return 0.0 if fall > 0 else 1.0
    return student_t_sf(fall / math.sqrt(variance), df)


def clustered_upper_bound(units: list[Unit], alpha: float) -> float:
    """Wilson's one-sided upper bound on the pooled rate at level 1 - alpha, on the drafts' effective number:
    their count over the design effect (the clustered variance over the binomial one)."""
    rate, variance = rate_and_variance(units)
    drafts = sum(n for _, n in units)
    if not drafts:
        return 1.0
    binomial = rate * (1 - rate) / drafts
    effective = drafts * binomial / variance if variance > 0 and binomial > 0 else drafts
    return rate_upper_bound(rate * effective, effective, alpha)


def prompts_for_power(first: list[Unit], ratio: float, keep: float, alpha: float) -> int:
    """Prompts a group needs for a fall to `ratio` x the first group's rate to be found with POWER by the test
    against `keep` x at `alpha`: the first group's per-prompt spread is measured (`first`), the fallen group's
    taken as it scaled by `ratio` (a rate's spread shrinks with it), the groups as independent (pairing only
    helps)."""
    rate, variance = rate_and_variance(first)
    gap = (keep - ratio) * rate
    if gap <= 0 or variance <= 0:
        return len(first)
    spread = variance * len(first) * (keep * keep + ratio)  # one prompt's share of the difference's variance
    # The test is Student's t on m - 1 degrees of freedom: m grows until its quantiles fit.
    for m in range(2, MAX_PROMPTS + 1):
        t = student_t_quantile(1 - alpha, m - 1) + student_t_quantile(POWER, m - 1)
        if t * t * spread / (gap * gap) <= m:
            return m
    return MAX_PROMPTS + 1


def student_t_quantile(q: float, df: float) -> float:
    """The t with P(T <= t) = q, by bisection on student_t_sf (q > 0.5)."""
    low, high = 0.0, 1.0
    while student_t_sf(high, df) > 1 - q:
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if student_t_sf(middle, df) > 1 - q else (low, middle)
    return high


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
