"""Oracle: specdoctor's model against transformers' Glm4MoeForCausalLM on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from specdoctor.runtime.checkpoint.loader import load_target_stage
from specdoctor.runtime.checkpoint.reader import Checkpoint
from tests.conftest import make_hf_checkpoint
from tests.helpers.reference_decoder import greedy_generate


def full_stage(path):
    checkpoint = Checkpoint(path)
    return load_target_stage(checkpoint, range(checkpoint.config.num_hidden_layers), True, True)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).abs().max() / reference.abs().max())


def logits_error(path, model, batch: int, length: int, seed: int) -> float:
    """The runtime's logits at every position of random ids against the transformers model's: the worse of
    the error over all positions and the error at the last one (scaled by that position's own logits)."""
    stage = full_stage(path)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = model(ids).logits
        ours = stage.logits(stage(ids, torch.arange(length).expand(batch, -1)))
    assert ours.shape == expected.shape
    return max(relative_error(ours, expected), relative_error(ours[:, -1], expected[:, -1]))


def test_checkpoint_has_index_and_several_shards(hf_checkpoint):
    checkpoint = Checkpoint(hf_checkpoint[0])
    assert checkpoint.layout == "index"
    assert len({t.shard for t in checkpoint.tensors.values()}) >= 3


@pytest.mark.parametrize("expert_path", ["gathered", "every", "grouped", "looped"])
def test_logits_match_transformers_at_every_position(hf_checkpoint, monkeypatch, expert_path):
    """Each way of running the routed experts: one batched matmul over gathered weights, every expert over
    every token, a grouped GEMM over the tokens sorted by expert, or a loop over the experts hit."""
    layers = "specdoctor.runtime.models.moe"
    monkeypatch.setattr(f"{layers}.GATHER_LIMIT_BYTES", 1 << 40 if expert_path == "gathered" else 0)
    monkeypatch.setattr(f"{layers}.EVERY_EXPERT_LIMIT_BYTES", 1 << 40 if expert_path == "every" else 0)
    monkeypatch.setattr(f"{layers}.MoE.grouped_from", 1 if expert_path == "grouped" else None)
    assert logits_error(*hf_checkpoint, batch=4, length=23, seed=1) < 1e-4


def assert_greedy_tokens_match_generate(path, model, prompt_lengths: tuple[int, ...], new_tokens: int) -> None:
    """The runtime's greedy tokens through its KV cache equal transformers' `generate` on random prompts."""
    stage = full_stage(path)
    generator = torch.Generator().manual_seed(2)
    for length in prompt_lengths:
        prompt = torch.randint(0, model.config.vocab_size, (1, length), generator=generator)
        with torch.no_grad():
            expected = model.generate(
                prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert greedy_generate(stage, [prompt[0].tolist()], new_tokens)[0] == expected[0, length:].tolist()


def assert_matches_transformers(path, model) -> None:
    """A family checkpoint against its transformers model: logits at every position, and greedy tokens."""
    assert logits_error(path, model, batch=3, length=21, seed=1) < 1e-4
    assert_greedy_tokens_match_generate(path, model, prompt_lengths=(3, 11), new_tokens=32)


def test_greedy_tokens_with_kv_cache_match_transformers_generate(hf_checkpoint):
    assert_greedy_tokens_match_generate(*hf_checkpoint, prompt_lengths=(5, 11), new_tokens=32)


def test_batched_prompts_of_different_lengths_equal_one_at_a_time(hf_checkpoint):
    stage = full_stage(hf_checkpoint[0])
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (3, 9, 6)]
    batched = greedy_generate(stage, prompts, 16)
    assert batched == [greedy_generate(stage, [p], 16)[0] for p in prompts]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(tie_word_embeddings=True, use_qk_norm=False, attention_bias=False),
        dict(first_k_dense_replace=4, n_routed_experts=0),  # all dense
        dict(norm_topk_prob=False, n_group=1, topk_group=1, partial_rotary_factor=1.0),
    ],
    ids=["tied-no-qknorm-no-bias", "dense", "unnormalised-router-full-rotary"],
)
def test_config_variants_match_transformers(tmp_path, overrides):
    reference = make_hf_checkpoint(tmp_path, seed=5, num_nextn_predict_layers=0, **overrides)
    assert logits_error(tmp_path, reference, batch=2, length=17, seed=4) < 1e-4


def test_experts_share_one_storage_that_survives_moving_the_module(hf_checkpoint):
    """Each expert's parameters are views of the layer's stacked tensors, also after `.to()`."""
    stage = full_stage(hf_checkpoint[0]).to(torch.float64)
    moe = next(layer.mlp for layer in stage.model.layers.values() if hasattr(layer.mlp, "experts"))
    expert = moe.experts[1]
    assert expert.gate_proj.weight.data_ptr() == moe.gate_up[1].data_ptr()
    assert torch.equal(moe.down[1], expert.down_proj.weight)
    with torch.no_grad():
        expert.up_proj.weight.fill_(0.5)  # what loading a checkpoint tensor does: copy into the part
    assert bool((moe.gate_up[1, expert.gate_proj.weight.shape[0] :] == 0.5).all())
