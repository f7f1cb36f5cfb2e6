"""The acceptance sweeps' decisions (`compare_groups`) at and just past each threshold, on groups of known counts,
so they are not guarded only by the slow server tests: a drop (concurrency, prefix cache) is an error from the
split ALPHA on; a context cliff is an error where Wilson's upper bound falls under the broken-drafter limit, and a
significant halving that is no cliff is a warning."""

from __future__ import annotations

import pytest

from specdoctor.checks.acceptance import broken_position0_limit
from specdoctor.probe.acceptance_sweeps import compare_groups
from specdoctor.probe.client import Window
from specdoctor.probe.stats import ALPHA, drop_p_value, rate_upper_bound
from specdoctor.runtime.decode.metrics import SpecMetrics

DRAFTS = 200


def window(accepted_at_0: int, drafts: int = DRAFTS) -> Window:
    """A group whose drafts accepted `accepted_at_0` times at position 0 (and nothing later)."""
    metrics = SpecMetrics(drafts, 3 * drafts, accepted_at_0, [accepted_at_0, 0, 0])
    return Window("per-request", metrics, [], [])


def errors_and_warnings(sweep) -> list[tuple[str, str]]:
    """(severity, what) of each finding that is not the sweep's info summary."""
    return [(f.severity, f.message.split(":")[0]) for f in sweep.findings if f.severity != "info"]


def edge(holds) -> int:
    """The largest position-0 count of DRAFTS for which `holds(count)`, found by walking the counts."""
    return max(x for x in range(DRAFTS + 1) if holds(x))


def test_a_drop_is_an_error_from_the_split_alpha_on_and_nothing_just_above_it():
    """Concurrency: the first group 150/200 at position 0, two others (ALPHA split in two)."""
    alpha = ALPHA / 2
    last = edge(lambda x: drop_p_value((150, DRAFTS), (x, DRAFTS)) < alpha)
    labels = ["1 in flight", "4 in flight", "16 in flight"]
    dropped = compare_groups("concurrency", [window(150), window(150), window(last)], labels, None, False, "hint")
    assert errors_and_warnings(dropped) == [("error", "acceptance falls with concurrency")]
    error = next(f for f in dropped.findings if f.severity == "error")
    assert error.data["from"] == "16 in flight" and error.data["p_value"] < alpha
    kept = compare_groups("concurrency", [window(150), window(150), window(last + 1)], labels, None, False, "hint")
    assert errors_and_warnings(kept) == [] and kept.status == "passed"


def test_a_context_cliff_is_an_error_where_the_upper_bound_falls_under_the_limit():
    """Context, no bigram baseline (the fixed 20 % floor): the first bucket 150/200; Wilson's bound at the split
    ALPHA decides a cliff, one acceptance either side of it."""
    alpha, limit = ALPHA / 2, broken_position0_limit(None)
    last = edge(lambda x: rate_upper_bound(x, DRAFTS, alpha) < limit)
    assert rate_upper_bound(last, DRAFTS, alpha) < limit <= rate_upper_bound(last + 1, DRAFTS, alpha)
    labels = ["128 tokens", "512 tokens", "1,536 tokens"]
    cliff = compare_groups("context", [window(150), window(150), window(last)], labels, None, True, "hint")
    assert errors_and_warnings(cliff) == [("error", "acceptance falls off a cliff")]
    # one more acceptance: no cliff, but a significant fall to under half the first bucket's rate is a warning
    halved = compare_groups("context", [window(150), window(150), window(last + 1)], labels, None, True, "hint")
    assert errors_and_warnings(halved) == [("warning", "acceptance falls with context")]


def test_a_context_fall_to_just_over_half_is_no_finding_even_when_significant():
    labels = ["128 tokens", "1,536 tokens"]
    first = 150
    over_half = first // 2 + 1  # 76 of 200: significant against 150 of 200, but not under half of 75 %
    assert drop_p_value((first, DRAFTS), (over_half, DRAFTS)) < ALPHA
    sweep = compare_groups("context", [window(first), window(over_half)], labels, None, True, "hint")
    assert errors_and_warnings(sweep) == []


def test_speculation_stopping_in_a_later_group_is_an_error_and_a_collapsed_first_group_is_not_run():
    labels = ["1 in flight", "4 in flight"]
    stopped = compare_groups("concurrency", [window(150), window(0, drafts=0)], labels, None, False, "hint")
    assert errors_and_warnings(stopped) == [
        ("error", "no draft was proposed at 4 in flight, where 1 in flight drafted")
    ]
    collapsed = compare_groups("context", [window(10), window(10)], ["128 tokens", "512 tokens"], None, True, "h")
    assert collapsed.status == "not run" and "already collapsed" in collapsed.summary


@pytest.mark.parametrize("baseline", [0.3, 0.05])
def test_the_cliff_limit_follows_the_bigram_baseline_where_there_is_one(baseline):
    """2 x the baseline, as check's broken-drafter limit: the same group is a cliff under one baseline and not
    under the other."""
    limit = broken_position0_limit(baseline)
    labels = ["128 tokens", "1,536 tokens"]
    group = 40  # 20 % of 200: Wilson's bound at ALPHA about 28 %
    sweep = compare_groups("context", [window(150), window(group)], labels, baseline, True, "hint")
    is_cliff = rate_upper_bound(group, DRAFTS, ALPHA) < limit
    assert any(f.severity == "error" for f in sweep.findings) is is_cliff
    assert is_cliff is (baseline == 0.3)
    assert "floor" not in sweep.summary  # a baseline was known
    without = compare_groups("context", [window(150), window(group)], labels, None, True, "hint")
    assert without.summary.endswith("cliff limit the 20% floor: the server returns no token ids")
