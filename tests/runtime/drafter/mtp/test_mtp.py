"""The MTP drafter: loading from a real checkpoint, its step against an independent reference built from
transformers' own Glm4MoeDecoderLayer, and the hidden state the engine feeds it (docs/engine-semantics.md §MTP
step)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.drafter.policy import Origin
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
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
    assert all(source.origin in (Origin.CHECKPOINT, Origin.ALIAS) for source in provenance.sources.values())
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


def copying_checkpoint(path, seed: int) -> None:
    """A tiny GLM-4.5 checkpoint (transformers' own class) whose MTP layer proposes the target's own argmax at the
    position it reads, i.e. the token the target just emitted, when it is fed the target's final-normed state:
    its block adds nothing to the residual (o_proj and every down_proj zero), eh_proj passes hnorm(previous
    hidden) through and ignores the embedding, hnorm and shared_head.norm are all ones and its head is lm_head.
    Its logits are then lm_head(final) times a positive number. Fed the pre-norm state instead, it computes
    lm_head(rmsnorm(hidden)) without the final norm's weights, which are random and of both signs here: other
    tokens."""
    make_hf_checkpoint(path, seed=seed)
    config = json.loads((path / "config.json").read_text())
    mtp, hidden = f"model.layers.{config['num_hidden_layers']}.", config["hidden_size"]
    generator = torch.Generator().manual_seed(seed)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = {shard: load_file(str(path / shard)) for shard in set(index["weight_map"].values())}
    tensors = {key: shards[shard][key] for key, shard in index["weight_map"].items()}
    changed = {
        "model.norm.weight": torch.randn(hidden, generator=generator),
        mtp + "eh_proj.weight": torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1),
        mtp + "hnorm.weight": torch.ones(hidden),
        mtp + "shared_head.norm.weight": torch.ones(hidden),
        mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
    }
    changed |= {
        key: torch.zeros_like(value)
        for key, value in tensors.items()
        if key.startswith(mtp) and key.endswith(("o_proj.weight", "down_proj.weight"))
    }
    assert any("experts" in key for key in changed) and any("o_proj" in key for key in changed)
    for key, value in changed.items():
        assert value.shape == tensors[key].shape, key
        shards[index["weight_map"][key]][key] = value.to(tensors[key].dtype).contiguous()
    for shard, content in shards.items():
        save_file(content, str(path / shard), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def copying_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("copying_mtp")
    copying_checkpoint(path, seed=61)
    return path


def copying_drafter_run(target: list[list[int]], limit: int, k: int) -> tuple[list[int], SpecMetrics]:
    """What the engine must report for a drafter whose k drafts all repeat the last emitted token, given the
    target's greedy tokens (`limit` + k of them per row): every proposal in commit order (the prompt pass's, then
    each step's, for the rows that go on), and the counters. Draft j is accepted while the target's next token
    repeats the last one; a step emits the accepted drafts and one token of the target's."""
    emitted = [1] * len(target)  # the prompt pass emits the first token
    proposals = [row[0] for row in target for _ in range(k)] if limit > 1 else []
    metrics = SpecMetrics()
    while any(n < limit for n in emitted):
        for row, tokens in enumerate(target):
            if emitted[row] >= limit:
                continue
            last = tokens[emitted[row] - 1]
            accepted = 0
            while accepted < k and tokens[emitted[row] + accepted] == last:
                accepted += 1
            metrics.record(accepted, k)
            emitted[row] = min(emitted[row] + accepted + 1, limit)
            if emitted[row] < limit:
                proposals += [tokens[emitted[row] - 1]] * k
    return proposals, metrics


COPY_PROMPTS = [[5, 9, 14, 3, 77], [101, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20], [250, 250, 3]]


@pytest.mark.parametrize("pp, k", [(1, 1), (2, 2)])
def test_the_engine_feeds_the_mtp_drafter_the_targets_final_normed_state(copying_model, pp, k):
    """Through the engine (the drafter on the last rank), a drafter built to copy the target's last token does
    exactly that, at the prompt pass and at every step, and the counters are the ones that copy dictates. Fed
    the pre-norm hidden state instead (a known engine bug, §MTP step), its proposals are other tokens."""
    limit = 24
    with Engine(RuntimeOptions(str(copying_model), pp=pp, drafter_policy="fixed", timeout=60)) as engine:
        target = engine.generate(COPY_PROMPTS, limit + k).tokens  # target-only greedy decoding
        result = engine.generate(COPY_PROMPTS, limit, num_speculative_tokens=k)
    assert result.tokens == [tokens[:limit] for tokens in target]  # lossless
    proposals, metrics = copying_drafter_run(target, limit, k)
    assert result.proposals == proposals
    assert result.metrics.to_dict() == metrics.to_dict()
    # The construction is not trivial here: the target both repeats itself (drafts accepted) and moves on.
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
