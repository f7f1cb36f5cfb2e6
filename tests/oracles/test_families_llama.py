"""Llama (`LlamaForCausalLM`, the target of EAGLE-3 heads and draft models) on checkpoints transformers saved,
against transformers' own class: logits at every position and 32 greedy tokens through the KV cache, with and
without Llama-3's rope scaling, untied and tied; then the pipeline runtime at PP 2, 3 and 4 against one process."""

from __future__ import annotations

import pytest

from tests.helpers.families import assert_pipeline_matches_single_process, save_dense_checkpoint
from tests.oracles.test_model_parity import assert_matches_transformers

# Llama-3.1's scaling over a context short enough that all three bands (kept, blended, divided) occur at
# head_dim 16: wavelengths of 6 to 4,000 positions against 64 / 4 and 64 / 1
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip


def make_llama_checkpoint(path, seed: int = 0, **overrides):
    return save_dense_checkpoint(path, "LlamaForCausalLM", seed, **overrides)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    return path, make_llama_checkpoint(path, rope_parameters=LLAMA3_ROPE)


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(tie_word_embeddings=True, attention_bias=True)],
    ids=["default-rope", "tied-with-attention-bias"],
)
def test_logits_and_greedy_tokens_match_transformers(tmp_path, overrides):
    assert_matches_transformers(tmp_path, make_llama_checkpoint(tmp_path, seed=1, **overrides))


def test_llama3_rope_scaling_matches_transformers(llama3):
    from specdoctor.runtime.checkpoint.reader import Checkpoint

    assert Checkpoint(llama3[0]).config.rope_scaling.factor == 8.0
    assert_matches_transformers(*llama3)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_pipeline_matches_single_process(llama3, pp):
    assert_pipeline_matches_single_process(*llama3, pp=pp, ks=())


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), "rope_type 'linear'"),
    ],
)
def test_settings_the_runtime_does_not_run_are_refused_not_approximated(tmp_path, overrides, reason):
    from specdoctor.errors import CheckpointError
    from specdoctor.runtime.checkpoint.reader import Checkpoint

    make_llama_checkpoint(tmp_path, **overrides)
    with pytest.raises(CheckpointError, match=reason):
        Checkpoint(tmp_path).require_runnable()


def test_a_llama_3_config_as_released_reads_its_rope_scaling():
    """Llama-3.1's config.json: `rope_scaling` beside a top-level `rope_theta` (transformers 4's spelling)."""
    from specdoctor.runtime.config import Llama3Scaling
    from specdoctor.runtime.models.registry import read_config

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    raw = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
        "rope_scaling": {**scaling, "rope_type": "llama3"}, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    config = read_config(raw)
    assert config.runtime_refusal is None and config.rope_theta == 500000.0 and config.head_dim == 128
    assert config.rope_scaling == Llama3Scaling(8.0, 1.0, 4.0, 8192)
    broken = read_config({**raw, "rope_scaling": {**scaling, "rope_type": "llama3", "low_freq_factor": 0}})
    assert "llama3 rope scaling needs positive" in broken.runtime_refusal
    missing = read_config({**raw, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert "llama3 rope scaling without low_freq_factor" in missing.runtime_refusal
