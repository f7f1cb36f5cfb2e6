"""The behaviour stage's verdict on what the drafter proposed: `behaviour.constant_proposals`, the signature of a
drafter that proposes one token whatever its context (garbage weights: a NaN head or embedding makes every draft
token 0), from the spread of the proposals (`proposal_profile`) and the thresholds in checks/proposals.py."""

from __future__ import annotations

import re

import pytest

from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.checks.behaviour import behaviour_findings
from specdoctor.checks.proposals import CONSTANT_PROPOSALS_MIN_COUNT, CONSTANT_PROPOSALS_SHARE, proposal_profile
from specdoctor.runtime.decode.metrics import SpecMetrics

K = 1


def one_token_message(count: int, token: int) -> re.Pattern:
    """The finding's message when every draft is `token`: entropy 0 (computed as -0.0, so it may print "-0.00")."""
    return re.compile(rf"100% of {count} drafts are token {token} \(entropy -?0\.00 bits\)")


def metrics_with_mean(mean: float, drafts: int = 40) -> dict:
    """The counters of `drafts` steps at k 1 whose mean acceptance length (bonus token counted) is `mean`."""
    metrics = SpecMetrics()
    accepted = round((mean - 1) * drafts)
    for step in range(drafts):
        metrics.record(1 if step < accepted else 0, K)
    assert metrics.mean_acceptance_length == mean
    return metrics.to_dict()


def constant_findings(proposals: list[int], mean: float):
    """The behaviour.constant_proposals findings of a lossless battery whose drafter proposed `proposals`."""
    findings = behaviour_findings(
        [True] * 9, metrics_with_mean(mean), proposal_profile(proposals), K, DEFAULT_MIN_ACCEPTANCE_LENGTH, "before"
    )
    assert [f.check for f in findings][:2] == ["behaviour.lossless", "behaviour.acceptance"]
    return [f for f in findings if f.check == "behaviour.constant_proposals"]


def test_proposal_profile_counts_the_top_token_share_and_entropy():
    assert proposal_profile([]) == {"count": 0, "top_token": None, "top_share": 0.0, "entropy_bits": 0.0}
    constant = proposal_profile([0] * 30)
    assert (constant["count"], constant["top_token"], constant["top_share"]) == (30, 0, 1.0)
    assert constant["entropy_bits"] == 0.0
    mixed = proposal_profile([5, 5, 5, 9, 9, 2, 5, 7])  # 4 of 8 are 5; the others 2, 1, 1
    assert (mixed["count"], mixed["top_token"], mixed["top_share"]) == (8, 5, 0.5)
    # -sum p log2 p: 1/2 * 1 + 1/4 * 2 + 2 * (1/8 * 3)
    assert mixed["entropy_bits"] == pytest.approx(1.75)
    assert proposal_profile(list(range(64)))["entropy_bits"] == pytest.approx(6.0)


def test_a_drafter_proposing_one_token_with_low_acceptance_is_an_error():
    """What a NaN drafter head gives (every draft token 0, none accepted): an error naming the token."""
    findings = constant_findings([0] * 40, mean=1.0)
    assert [(f.check, f.severity) for f in findings] == [("behaviour.constant_proposals", "error")]
    assert one_token_message(40, 0).fullmatch(findings[0].message)
    assert findings[0].stage == "before" and "garbage weights" in findings[0].hint


def test_a_constant_drafter_whose_drafts_are_accepted_is_a_warning():
    """A target that itself repeats one token accepts a constant drafter's drafts: suspicious, not a failure.
    The boundary: a mean acceptance length of exactly the minimum is not below it."""
    assert [f.severity for f in constant_findings([7] * 40, mean=2.0)] == ["warning"]
    assert [f.severity for f in constant_findings([7] * 40, mean=DEFAULT_MIN_ACCEPTANCE_LENGTH)] == ["warning"]
    assert [f.severity for f in constant_findings([7] * 40, mean=1.375)] == ["error"]  # just under 1.4


def test_varied_proposals_give_no_finding():
    assert constant_findings(list(range(40)), mean=1.0) == []
    assert constant_findings([i % 5 for i in range(200)], mean=1.0) == []  # five tokens, 20 % each


def test_the_count_threshold_exactly_and_just_under():
    """One token in half of at least 20 drafts (checks/behaviour.py): 20 identical drafts fire, 19 do not."""
    at = [3] * CONSTANT_PROPOSALS_MIN_COUNT
    [finding] = constant_findings(at, mean=1.0)
    assert one_token_message(20, 3).fullmatch(finding.message)
    assert constant_findings(at[:-1], mean=1.0) == []  # 19 identical drafts say nothing yet


def test_the_share_threshold_exactly_and_just_under():
    # 40 drafts: 20 of token 3 (exactly half) against 19 (47.5 %), the rest all different.
    at = [3] * 20 + list(range(100, 120))
    under = [3] * 19 + list(range(100, 121))
    assert proposal_profile(at)["top_share"] == CONSTANT_PROPOSALS_SHARE
    assert [f.message for f in constant_findings(at, mean=1.0)] == [
        f"50% of 40 drafts are token 3 (entropy {proposal_profile(at)['entropy_bits']:.2f} bits)"
    ]
    assert proposal_profile(under)["count"] == 40 and proposal_profile(under)["top_share"] < CONSTANT_PROPOSALS_SHARE
    assert constant_findings(under, mean=1.0) == []
