"""The acceptance thresholds check and probe share: the bigram baseline they rest on, the broken and chain
signatures, and the content rule for embedding tables that cannot be trained ones."""

from __future__ import annotations

from specdoctor.checks.acceptance import acceptance_findings, bigram_baseline, is_broken, is_chain_broken
from specdoctor.checks.drafter import tensor_findings
from specdoctor.runtime.drafter.measure import TensorRecord


def test_bigram_baseline_scores_each_output_with_the_table_of_the_others():
    # Output 0's pairs (1,2) (2,1) (1,2): output 1 says 1 -> 2 (right twice), and has no 2 -> (one miss).
    # Output 1's pairs (1,2) (2,3): output 0 says 1 -> 2 (right), 2 -> 1 (wrong). 3 of 5 right.
    assert bigram_baseline([[1, 2, 1, 2], [1, 2, 3]]) == 3 / 5
    assert bigram_baseline([[7]]) is None


def test_the_broken_signature_is_relative_to_the_models_own_baseline():
    assert is_broken(1.3, [0.3, 0.0], baseline=0.2)  # under twice the baseline
    assert not is_broken(1.3, [0.3, 0.0], baseline=0.1)
    assert is_broken(1.1, [], baseline=None) and not is_broken(1.3, [], baseline=None)  # SGLang: mean only
    errors = acceptance_findings("behaviour", "figures", 1.3, [0.3, 0.0], 1.4, "before", baseline=0.2)
    assert "drafter broken (position 0 under 40%)" in errors[0].message


def test_the_chain_signature_needs_a_healthy_first_position():
    assert is_chain_broken([0.8, 0.1]) and not is_chain_broken([0.8, 0.6]) and not is_chain_broken([0.2, 0.0])


def test_an_all_zero_or_all_equal_embedding_table_is_an_error_without_the_checkpoint():
    base = {"nan": 0, "inf": 0, "mean": 0.0, "std": 0.0, "absmax": 0.0, "numel": 10}
    zeros = TensorRecord(**base, zero_fraction=1.0, duplicate_row_fraction=1.0)
    zeros = tensor_findings("embed_tokens.weight", zeros, "s")
    assert [f.check for f in zeros] == ["drafter.stats"] and "100% of its values are zero" in zeros[0].message
    repeated = TensorRecord(**base, zero_fraction=0.0, duplicate_row_fraction=0.995)
    assert "repeat another row" in tensor_findings("layers.4.shared_head.head.weight", repeated, "s")[0].message
    assert tensor_findings("layers.4.eh_proj.weight", TensorRecord(**base, zero_fraction=1.0), "s") == []
