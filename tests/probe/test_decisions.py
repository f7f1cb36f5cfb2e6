"""The acceptance sweeps' decisions (`compare_groups`) and the tests they rest on (`probe/stats.py`), on groups of
known counts, so they are not guarded only by the slow server tests: Student's t against its published table, a
fall with the request as the unit (paired where the prompts are the same), each threshold at and just past its
edge, and the stated power and false-positive rate of a sized sweep, simulated."""

from __future__ import annotations

import random

import pytest

from specdoctor.checks.acceptance import broken_position0_limit
from specdoctor.probe.acceptance_sweeps import CONTEXT_KEEP, CONTEXT_SIZED_FOR, compare_groups
from specdoctor.probe.client import Window
from specdoctor.probe.corpus import STARTS
from specdoctor.probe.options import ALPHA
from specdoctor.probe.output_sweeps import two_sample_findings
from specdoctor.probe.sampling_settings import SamplingSetting
from specdoctor.probe.stats import (
    MAX_PROMPTS,
    POWER,
    clustered_upper_bound,
    fall_p_value,
    prompts_for_power,
    rate_and_variance,
    student_t_sf,
)
from specdoctor.runtime.decode.metrics import SpecMetrics

PROMPTS, DRAFTS = 10, 20  # a group: 10 requests of 20 drafts each


def window(per_prompt: list[int], drafts: int = DRAFTS) -> Window:
    """A group of requests whose drafts accepted `per_prompt[i]` times at position 0 in request i (and nothing
    later), counted per request."""
    units = [SpecMetrics(drafts, 3 * drafts, x, [x, 0, 0]) for x in per_prompt]
    total = SpecMetrics()
    for unit in units:
        total.add(unit)
    return Window("per-request", total, [{} for _ in units], [], units)


def spread(total: int, prompts: int = PROMPTS) -> list[int]:
    """`total` acceptances over the prompts as evenly as they go (the first ones one more)."""
    return [total // prompts + (i < total % prompts) for i in range(prompts)]


def findings(sweep) -> list[tuple[str, str]]:
    """(severity, what) of each finding that is not the sweep's info summary."""
    return [(f.severity, f.message.split(":")[0]) for f in sweep.findings if f.severity != "info"]


@pytest.mark.parametrize(
    "t, df, tail", [(2.228, 10, 0.025), (4.032, 5, 0.005), (3.850, 20, 0.0005), (6.314, 1, 0.05), (1.96, 1e9, 0.025)]
)
def test_students_t_gives_its_published_table(t, df, tail):
    assert student_t_sf(t, df) == pytest.approx(tail, rel=2e-3)
    assert student_t_sf(-t, df) == pytest.approx(1 - tail, rel=2e-3)


def test_a_rates_variance_counts_the_request_and_never_falls_under_the_binomial():
    even, clustered = [10] * PROMPTS, [20, 0] * (PROMPTS // 2)  # both 100 of 200
    rate, binomial = rate_and_variance([(x, DRAFTS) for x in even])
    assert rate == 0.5 and binomial == pytest.approx(0.5 * 0.5 / 200)  # no spread between requests: the floor
    _, wide = rate_and_variance([(x, DRAFTS) for x in clustered])
    assert wide > 10 * binomial
    assert clustered_upper_bound([(x, DRAFTS) for x in clustered], ALPHA) > clustered_upper_bound(
        [(x, DRAFTS) for x in even], ALPHA
    )


def test_pairing_finds_a_fall_every_prompt_shows_where_the_groups_alone_do_not():
    first = [4, 16, 6, 14, 8, 12, 5, 15, 7, 13]  # prompts that differ widely
    later = [x - 2 - i % 2 for i, x in enumerate(first)]  # every one of them two or three acceptances fewer
    pairs = ([(x, DRAFTS) for x in first], [(x, DRAFTS) for x in later])
    assert fall_p_value(*pairs, paired=True) < ALPHA < 0.05 < fall_p_value(*pairs, paired=False)
    assert fall_p_value(pairs[0], pairs[0], paired=True) == 0.5  # the same counts: no fall, t = 0


def test_a_fall_with_the_same_prompts_is_an_error_from_the_split_alpha_on():
    """Concurrency: the first group 150/200 at position 0, two others (ALPHA split in two), prompt by prompt."""
    alpha, first = ALPHA / 2, spread(150)
    fallen = lambda total: [(x, DRAFTS) for x in spread(total)]  # noqa: E731
    last = max(x for x in range(151) if fall_p_value([(x, DRAFTS) for x in first], fallen(x), paired=True) < alpha)
    labels = ["1 in flight", "4 in flight", "16 in flight"]
    dropped = compare_groups("concurrency", [window(first), window(first), window(spread(last))], labels, None, "h")
    assert findings(dropped) == [("error", "acceptance falls with concurrency")]
    error = next(f for f in dropped.findings if f.severity == "error")
    assert error.data["from"] == "16 in flight" and error.data["p_value"] < alpha
    kept = compare_groups("concurrency", [window(first), window(first), window(spread(last + 1))], labels, None, "h")
    assert findings(kept) == [] and kept.status == "passed"
    assert "paired per-request variance" in kept.summary


def test_a_context_cliff_is_an_error_where_the_clustered_upper_bound_falls_under_the_limit():
    """No bigram baseline (the fixed 20 % floor): the first bucket 150/200; the bound at the split ALPHA decides."""
    alpha, limit = ALPHA / 2, broken_position0_limit(None)
    bound = lambda total: clustered_upper_bound([(x, DRAFTS) for x in spread(total)], alpha)  # noqa: E731
    last = max(x for x in range(201) if bound(x) < limit)
    assert bound(last) < limit <= bound(last + 1)
    labels = ["128 tokens", "512 tokens", "1,536 tokens"]
    buckets = [window(spread(150)), window(spread(150))]
    cliff = compare_groups("context", [*buckets, window(spread(last))], labels, None, "h", cliff=True, keep=0.5)
    assert findings(cliff) == [("error", "acceptance falls off a cliff")]
    # its evidence is the bound under the limit, not the fall test's p-value (which need not reject)
    evidence = f"at most {bound(last):.1%} with confidence, under the broken-drafter limit {limit:.1%})"
    message = next(f.message for f in cliff.findings if f.severity == "error")
    assert message.endswith(evidence) and "p = " not in message
    # one acceptance more: no cliff, and a fall to under half of 75 % is an error of its own
    fallen = compare_groups("context", [*buckets, window(spread(last + 1))], labels, None, "h", cliff=True, keep=0.5)
    assert findings(fallen) == [("error", "acceptance falls with context to under 50% of its rate at 128 tokens")]


def test_a_context_fall_to_over_the_kept_share_is_no_finding_even_when_significant():
    first, later = spread(150), spread(90)  # 75 % -> 45 %: a significant fall, to 60 % of the first rate
    units = [(x, DRAFTS) for x in first], [(x, DRAFTS) for x in later]
    assert fall_p_value(*units, paired=True) < ALPHA
    sweep = compare_groups("context", [window(first), window(later)], ["128", "1,536"], None, "h", cliff=True, keep=0.5)
    assert findings(sweep) == []


def test_speculation_stopping_in_a_later_group_is_an_error_and_a_collapsed_first_group_is_not_run():
    labels = ["1 in flight", "4 in flight"]
    stopped = compare_groups("concurrency", [window(spread(150)), window([0] * PROMPTS, drafts=0)], labels, None, "h")
    assert findings(stopped) == [("error", "no draft was proposed at 4 in flight, where 1 in flight drafted")]
    collapsed = compare_groups("context", [window(spread(10))] * 2, ["128 tokens", "512 tokens"], None, "h", cliff=True)
    assert collapsed.status == "not run" and "already collapsed" in collapsed.summary


@pytest.mark.parametrize("baseline", [0.3, 0.05])
def test_the_cliff_limit_follows_the_bigram_baseline_where_there_is_one(baseline):
    """2 x the baseline, as check's broken-drafter limit: the same group is a cliff under one baseline and not
    under the other."""
    limit = broken_position0_limit(baseline)
    group = spread(40)  # 20 % of 200: its bound at ALPHA about 28 %
    is_cliff = clustered_upper_bound([(x, DRAFTS) for x in group], ALPHA) < limit
    sweep = compare_groups("context", [window(spread(150)), window(group)], ["128", "1,536"], baseline, "h", cliff=True)
    assert any(f.message.startswith("acceptance falls off a cliff") for f in sweep.findings) is is_cliff
    assert is_cliff is (baseline == 0.3)
    assert "floor" not in sweep.summary  # a baseline was known
    without = compare_groups("context", [window(spread(150)), window(group)], ["128", "1,536"], None, "h", cliff=True)
    assert "cliff limit the 20% floor: the server returns no token ids" in without.summary


def simulated(rng: random.Random, rates: list[float], drafts: int) -> list[tuple[int, int]]:
    """One group: request i draws `drafts` drafts at its own rate."""
    return [(sum(rng.random() < rate for _ in range(drafts)), drafts) for rate in rates]


def test_a_sized_context_sweep_has_its_stated_power_and_its_stated_false_positive_rate():
    """Prompts whose own rates spread around 50 % (requests differ: a clustered sample), the sweep sized from a
    first bucket of them for a fall to CONTEXT_SIZED_FOR at alpha 0.05 (a rate 500 runs resolve): that fall is
    found in at least POWER of the runs, and a bucket at exactly CONTEXT_KEEP of the rate (the null's edge) is
    called a fall in about alpha of them (within the binomial interval of 500 runs). Each run sends what the sweep
    sends: the sized count, capped at the corpus' starts (here the rule asks for 73, so 64 are sent)."""
    rng, alpha, drafts, runs = random.Random(0), 0.05, 14, 500
    prompt_rates = lambda m: [min(0.95, max(0.05, rng.gauss(0.5, 0.15))) for _ in range(m)]  # noqa: E731
    first = simulated(rng, prompt_rates(8), drafts)
    m = prompts_for_power(first, CONTEXT_SIZED_FOR, CONTEXT_KEEP, alpha)
    assert 8 <= m < MAX_PROMPTS
    sent = min(m, STARTS)
    found = edge = 0
    for _ in range(runs):
        rates = prompt_rates(sent)
        reference = simulated(rng, rates, drafts)
        fallen = simulated(rng, [r * CONTEXT_SIZED_FOR for r in rates], drafts)
        at_keep = simulated(rng, [r * CONTEXT_KEEP for r in rates], drafts)
        found += fall_p_value(reference, fallen, CONTEXT_KEEP, paired=True) < alpha
        edge += fall_p_value(reference, at_keep, CONTEXT_KEEP, paired=True) < alpha
    assert found / runs >= POWER, (sent, found)
    assert edge / runs <= alpha + 3 * (alpha * (1 - alpha) / runs) ** 0.5, (sent, edge)


def two_sample(ours: list[tuple[int, int]], theirs: list[tuple[int, int]], alpha: float = ALPHA) -> list:
    result = {"top_draws": ours}
    return two_sample_findings("http://reference", SamplingSetting(0.6, 0.95), result, {"top_draws": theirs}, alpha)


def test_the_two_sample_sampling_test_is_an_error_at_its_alpha_and_not_just_before_it():
    """Eight requests a side drawing the first-ranked token 60 of 128 times against the reference's 60 + d: the
    smallest d that is an error at ALPHA, its p-value just under, d - 1's just over; either way round (two-sided),
    and the same counts on both sides are never one. A sample as clustered as its requests' spread says is a wider
    one: the same mean shift is weaker where the requests differ among themselves."""
    ours = [(60, 128)] * 4 + [(58, 128), (62, 128)] * 2
    shift = next(d for d in range(1, 68) if two_sample(ours, [(x + d, n) for x, n in ours]))
    found = two_sample(ours, [(x + shift, n) for x, n in ours])
    assert found[0].severity == "error" and "without speculation (http://reference)" in found[0].message
    just_over = {"top_draws": ours}
    assert not two_sample_findings(
        "r", SamplingSetting(0.6, 0.95), just_over, {"top_draws": [(x + shift - 1, n) for x, n in ours]}, ALPHA
    )
    assert just_over["two_sample_p_value"] >= ALPHA > found[0].data["two_sample_p_value"]
    assert two_sample([(x + shift, n) for x, n in ours], ours)  # the other way round
    assert not two_sample(ours, ours)
    spread = [(30, 128), (90, 128)] * 4  # the same 60 a request on average, spread across requests
    assert not two_sample(spread, [(x + shift, n) for x, n in spread])
