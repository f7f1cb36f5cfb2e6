"""Layer partition and placement: vLLM's goldens and errors (docs/engine-semantics.md §Partition)."""

from __future__ import annotations

import pytest

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.models.registry import read_config
from specdoctor.runtime.partition import layer_ranges, placements


@pytest.mark.parametrize(
    "layers, pp, expected",
    [
        (3, 2, [range(0, 2), range(2, 3)]),
        (4, 3, [range(0, 1), range(1, 3), range(3, 4)]),
        (5, 3, [range(0, 2), range(2, 4), range(4, 5)]),
        (45, 4, [range(0, 11), range(11, 22), range(22, 34), range(34, 45)]),
        (4, 1, [range(0, 4)]),
    ],
)
def test_default_partition_goldens(layers, pp, expected, monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert layer_ranges(layers, pp) == expected


def test_explicit_partition_and_environment_variable(monkeypatch):
    assert layer_ranges(45, 4, "14,12,12,7") == [range(0, 14), range(14, 26), range(26, 38), range(38, 45)]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert layer_ranges(4, 2) == [range(0, 1), range(1, 4)]
    assert layer_ranges(4, 2, "2,2") == [range(0, 2), range(2, 4)]  # the flag wins over the variable


@pytest.mark.parametrize(
    "spec, message",
    [
        ("14,12,12", "has 3 entries"),
        ("14,12,12,8", "sums to 46"),
        ("a,b,c,d", "not a comma-separated"),
        ("", "not a comma-separated"),
        ("46,-1,0,0", "negative number of layers"),
    ],
)
def test_bad_partitions_are_clear_errors(spec, message):
    with pytest.raises(SpecdoctorError, match=message):
        layer_ranges(45, 4, spec)


def test_ranks_without_layers_are_allowed_as_in_vllm(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert layer_ranges(45, 4, "45,0,0,0") == [range(0, 45), range(45, 45), range(45, 45), range(45, 45)]
    assert layer_ranges(3, 4) == [range(0, 1), range(1, 2), range(2, 3), range(3, 3)]  # the last rank gets none


def test_an_empty_partition_variable_is_an_error_as_in_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "")
    with pytest.raises(SpecdoctorError, match="not a comma-separated"):
        layer_ranges(4, 2)


def config(tied: bool) -> ModelConfig:
    return read_config(
        {
            "vocab_size": 64,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": tied,
        }
    )


def test_placement_owners():
    ranks = placements(config(tied=False), 3, has_drafter=True)
    assert [r.has_embedding for r in ranks] == [True, False, False]
    assert [r.has_head for r in ranks] == [False, False, True]
    assert [r.has_drafter for r in ranks] == [False, False, True]
    # GLM-4.5 MoE's vLLM model ignores tie_word_embeddings: the embedding stays on the first rank only.
    tied = placements(config(tied=True), 3, has_drafter=True)
    assert [r.has_embedding for r in tied] == [True, False, False]
    single = placements(config(tied=False), 1, has_drafter=True)[0]
    assert single.has_embedding and single.has_head and single.has_drafter
