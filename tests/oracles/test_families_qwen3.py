"""Dense Qwen3 (`Qwen3ForCausalLM`, the DSpark drafters' target) on checkpoints transformers saved, against
transformers' own class: logits at every position and greedy tokens through the KV cache, untied and
tied embeddings; then the pipeline runtime at PP 2 against one process."""

from __future__ import annotations

import pytest

from tests.helpers.families import assert_pipeline_matches_single_process, save_dense_checkpoint
from tests.oracles.test_model_parity import assert_matches_transformers


def make_qwen3_checkpoint(path, seed: int = 0, **overrides):
    return save_dense_checkpoint(path, "Qwen3ForCausalLM", seed, **overrides)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    return path, make_qwen3_checkpoint(path)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_greedy_tokens_match_transformers(qwen3, tmp_path, tied):
    path, model = (tmp_path, make_qwen3_checkpoint(tmp_path, seed=1, tie_word_embeddings=True)) if tied else qwen3
    assert_matches_transformers(path, model)


def test_pipeline_matches_single_process(qwen3):
    assert_pipeline_matches_single_process(*qwen3, pp=2, ks=())


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(use_sliding_window=True, sliding_window=8), "use_sliding_window"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), "rope_type 'linear'"),
    ],
)
def test_settings_the_runtime_does_not_run_are_refused_not_approximated(tmp_path, overrides, reason):
    from specdoctor.errors import CheckpointError
    from specdoctor.runtime.checkpoint.reader import Checkpoint

    make_qwen3_checkpoint(tmp_path, **overrides)
    with pytest.raises(CheckpointError, match=reason):
        Checkpoint(tmp_path).require_runnable()
