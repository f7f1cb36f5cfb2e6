"""The MTP drafter: loading from a real checkpoint, and its step against an independent reference
built from transformers' own Glm4MoeDecoderLayer (docs/engine-semantics.md §MTP step)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdoctor.runtime.checkpoint.reader import Checkpoint
from tests.conftest import make_hf_checkpoint
from tests.helpers.loading import load_target_and_drafter


def hf_block(checkpoint: Checkpoint, hf_config, layer_id: int):
    """transformers' decoder layer holding the MTP layer's block weights (experts packed its way)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

    block = Glm4MoeDecoderLayer(hf_config, layer_id).eval()
    prefix = f"model.layers.{layer_id}."
    state = {}
    for name in block.state_dict():
        if ".experts." in name:
            continue
        state[name] = checkpoint.read(prefix + name)
    experts = range(hf_config.n_routed_experts)
    expert = lambda e, part: checkpoint.read(f"{prefix}mlp.experts.{e}.{part}.weight")  # noqa: E731
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in experts]
    )
    state["mlp.experts.down_proj"] = torch.stack([expert(e, "down_proj") for e in experts])
    block.load_state_dict(state)
    return block


def reference_step(checkpoint, hf_config, layer_id, embedding, tokens, prev_hidden, positions):
    """e = embed(token); e[position == 0] = 0; h = eh_proj(cat(enorm(e), hnorm(prev))); h = block(h)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

    prefix = f"model.layers.{layer_id}."
    read = lambda name: checkpoint.read(prefix + name)  # noqa: E731

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf_config.rms_norm_eps))

    embeds = F.embedding(tokens, embedding)
    embeds[positions == 0] = 0
    x = torch.cat([rms(embeds, read("enorm.weight")), rms(prev_hidden, read("hnorm.weight"))], dim=-1)
    x = F.linear(x, read("eh_proj.weight"))
    rotary = Glm4MoeRotaryEmbedding(hf_config)(x, positions)
    length = tokens.shape[1]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    hidden = hf_block(checkpoint, hf_config, layer_id)(x, attention_mask=mask, position_embeddings=rotary)
    logits = F.linear(rms(hidden, read("shared_head.norm.weight")), read("shared_head.head.weight"))
    return hidden, logits


def test_drafter_loads_every_tensor_from_the_checkpoint(hf_checkpoint):
    checkpoint = Checkpoint(hf_checkpoint[0])
    _, drafter, provenance = load_target_and_drafter(checkpoint)
    assert not provenance.unfilled()
    assert set(provenance.sources) == set(drafter.state_dict())
    assert all(source.startswith(("checkpoint:", "alias:")) for source in provenance.sources.values())
    torch.testing.assert_close(drafter.embed_tokens.weight, checkpoint.read("model.embed_tokens.weight"))


def test_mtp_step_matches_reference_built_from_transformers(hf_checkpoint):
    path, reference = hf_checkpoint
    checkpoint = Checkpoint(path)
    _, drafter, _ = load_target_and_drafter(checkpoint)
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 320, (2, 9), generator=generator)
    prev_hidden = torch.randn(2, 9, 64, generator=generator)
    positions = torch.arange(9).expand(2, -1)
    with torch.no_grad():
        hidden, logits = drafter(tokens, prev_hidden, positions)
        expected_hidden, expected_logits = reference_step(
            checkpoint,
            reference.config,
            4,
            checkpoint.read("model.embed_tokens.weight"),
            tokens,
            prev_hidden,
            positions,
        )
    torch.testing.assert_close(hidden, expected_hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-5)


def test_embedding_is_ignored_at_position_zero_only(hf_checkpoint):
    _, drafter, _ = load_target_and_drafter(Checkpoint(hf_checkpoint[0]))
    prev = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(8))
    positions = torch.arange(3)[None]
    with torch.no_grad():
        _, a = drafter(torch.tensor([[1, 2, 3]]), prev, positions)
        _, b = drafter(torch.tensor([[9, 2, 3]]), prev, positions)
        _, c = drafter(torch.tensor([[1, 9, 3]]), prev, positions)
    torch.testing.assert_close(a, b)  # the token at position 0 does not matter
    assert not torch.allclose(a[:, 1], c[:, 1])  # later tokens do


def test_every_chain_step_runs_the_first_mtp_layer_as_vllm_does(tmp_path):
    """vLLM 0.32's proposer never passes spec_step_idx, so with two MTP layers every draft step runs
    layer N (the model code's `spec_step_idx % num_mtp_layers` with its default 0)."""
    hf_config = make_hf_checkpoint(tmp_path, seed=9, num_nextn_predict_layers=2).config
    checkpoint = Checkpoint(tmp_path)
    _, drafter, provenance = load_target_and_drafter(checkpoint)
    assert not provenance.unfilled() and sorted(drafter.layers) == ["4", "5"]
    tokens, positions = torch.tensor([[5, 6, 7]]), torch.arange(1, 4)[None]
    prev = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(10))
    embedding = checkpoint.read("model.embed_tokens.weight")
    with torch.no_grad():
        _, logits = drafter(tokens, prev, positions)
        expected = {
            layer: reference_step(checkpoint, hf_config, layer, embedding, tokens, prev, positions) for layer in (4, 5)
        }
    torch.testing.assert_close(logits, expected[4][1], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(logits, expected[5][1], rtol=1e-3, atol=1e-3)
