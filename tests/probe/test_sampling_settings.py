"""What the reported top log-probabilities fix about a sampled token's rank under the settings users send, at and
just past each decision's edge (the sweep itself runs against live servers in test_sweeps.py)."""

from __future__ import annotations

import math

import pytest

from specdoctor.errors import SpecdoctorError
from specdoctor.probe.sampling_settings import (
    EDGE_MARGIN,
    SamplingSetting,
    merge_sparse_bins,
    parse_settings,
    rank_probabilities,
)

RAW = (0.7, 0.2, 0.05, 0.02, 0.01)  # the reported top 5; 0.02 left for the rest of the vocabulary
RANKED = [math.log(p) for p in RAW]


def tempered(temperature: float, count: int) -> list[float]:
    weights = [p ** (1 / temperature) for p in RAW[:count]]
    return [w / sum(weights) for w in weights]


def test_at_temperature_1_the_ranks_are_the_reported_probabilities_and_the_rest_is_what_they_leave():
    assert rank_probabilities(RANKED, SamplingSetting(1.0)) == pytest.approx([*RAW, 0.02])


def test_a_nucleus_that_ends_inside_the_reported_tokens_for_every_tail_fixes_the_ranks():
    """At 0.6 the top two hold 98.6-98.8 % of the tempered mass whatever the tail holds (at most 0.02 spread at
    most 0.01 a token), the top one 87.7-87.9 %: top-p 0.95 keeps exactly two."""
    found = rank_probabilities(RANKED, SamplingSetting(0.6, 0.95))
    assert found == pytest.approx([*tempered(0.6, 2), 0, 0, 0, 0])


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.9 - 2 * EDGE_MARGIN, 2), (0.9, None), (0.9 + 2 * EDGE_MARGIN, 3)],
    ids=["just-inside", "on-the-edge", "just-past"],
)
def test_a_nucleus_edge_within_the_margin_is_left_undecided(top_p, expected):
    """At temperature 1 the top two hold exactly 0.9."""
    found = rank_probabilities(RANKED, SamplingSetting(1.0, top_p))
    if expected is None:
        assert found is None
    else:
        assert found == pytest.approx([*[p / sum(RAW[:expected]) for p in RAW[:expected]], *[0] * (6 - expected)])


def test_a_nucleus_reaching_into_the_unreported_tail_is_undecided():
    assert rank_probabilities(RANKED, SamplingSetting(1.0, 0.99)) is None


def test_below_temperature_1_without_a_cut_the_tail_leaves_the_ranks_open():
    assert rank_probabilities(RANKED, SamplingSetting(0.6)) is None


def test_a_top_k_within_the_reported_tokens_fixes_the_ranks_at_any_temperature():
    assert rank_probabilities(RANKED, SamplingSetting(1.5, 1.0, 3)) == pytest.approx([*tempered(1.5, 3), 0, 0, 0])
    assert rank_probabilities(RANKED, SamplingSetting(1.5)) is None  # above 1 the tail has no bound


def test_the_tail_bound_below_temperature_1_holds_for_the_worst_tail():
    """The most the tail can weigh at T < 1: all of its mass in tokens as likely as the last reported one. The
    nucleus the bound decides is the one that worst tail gives too."""
    setting = SamplingSetting(0.6, 0.95)
    worst = [*RAW, 0.01, 0.01]  # the 0.02 left, as two tokens of 0.01
    weights = [p ** (1 / 0.6) for p in worst]
    masses = [sum(weights[: i + 1]) / sum(weights) for i in range(len(weights))]
    assert next(i for i, mass in enumerate(masses, 1) if mass >= 0.95) == 2
    assert len([p for p in rank_probabilities(RANKED, setting) if p]) == 2


def test_sparse_bins_fold_into_the_bin_before_them():
    probabilities = [[0.9, 0.09, 0.01]] * 100  # expected 90, 9, 1
    outcomes = [0] * 90 + [1] * 9 + [2]
    merged = merge_sparse_bins(probabilities, outcomes, 5)
    assert merged is not None
    rows, landed = merged
    assert rows[0] == pytest.approx([0.9, 0.1]) and landed.count(1) == 10
    assert merge_sparse_bins([[0.99, 0.01]] * 100, [0] * 100, 5) is None  # one bin left: nothing to test


def test_settings_parse_and_bad_ones_are_one_line():
    assert parse_settings("1,0.6:0.95,0.7:1:40") == (
        SamplingSetting(1.0),
        SamplingSetting(0.6, 0.95),
        SamplingSetting(0.7, 1.0, 40),
    )
    for bad in ("0", "0.6:1.2", "hot", "1:1:1:1", "0.6:0.9:-1"):
        with pytest.raises(SpecdoctorError, match="each setting is TEMPERATURE"):
            parse_settings(bad)
