"""The MLA families (DeepSeek-V3, GLM-4.7-Flash, and DeepSeek-V3.2 / GLM-5 with DeepSeek Sparse
Attention) on checkpoints transformers saved, against transformers' own classes: logits at every
position, greedy tokens through the KV cache against `generate`, and the MTP step against transformers'
MtpLayer around the family's own decoder layer; then the pipeline runtime at PP 2-4 against PP 1,
speculative against plain greedy, and check finding and repairing the legacy loading at PP 4."""

from __future__ import annotations

import json

import pytest
import torch

from specdoctor.runtime.models.deepseek_v3 import ARCHITECTURES, INDEXER_ROPE_INTERLEAVED
from specdoctor.workflow.check import run_check
from tests.commands.test_check import specdoctor
from tests.helpers.families import (
    SHIPS_OWN_COPIES,
    assert_pipeline_matches_single_process,
    checkpoints_by_architecture,
    make_family_checkpoint,
)
from tests.helpers.loading import mtp_step_error
from tests.oracles.test_model_parity import assert_matches_transformers, logits_error
from tests.workflow.test_check import check_options

DSA_TOPK = 6  # fewer tokens than the test contexts hold, so the indexer's choice decides the output


def make_mla_checkpoint(path, architecture: str, seed: int = 0, **overrides):
    sparse = dict(index_topk=DSA_TOPK) if architecture in INDEXER_ROPE_INTERLEAVED else {}
    return make_family_checkpoint(path, architecture, seed, **sparse, **overrides)


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory):
    """{architecture: (directory, transformers model)}."""
    return checkpoints_by_architecture(tmp_path_factory, ARCHITECTURES, make_mla_checkpoint)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_and_greedy_tokens_through_the_latent_cache_match_transformers(mla_models, architecture):
    assert_matches_transformers(*mla_models[architecture])


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


@pytest.mark.parametrize(
    "architecture, overrides",
    [
        ("DeepseekV3ForCausalLM", dict(rope_parameters=YARN)),
        ("DeepseekV3ForCausalLM", dict(q_lora_rank=None, first_k_dense_replace=0, n_shared_experts=2)),
        ("Glm4MoeLiteForCausalLM", dict(rope_parameters=YARN, norm_topk_prob=False, routed_scaling_factor=2.5)),
    ],
    ids=["yarn", "one-q-proj-all-moe", "lite-yarn-unnormalised-router"],
)
def test_config_variants_match_transformers(tmp_path, architecture, overrides):
    model = make_mla_checkpoint(tmp_path, architecture, seed=5, **overrides)
    assert logits_error(tmp_path, model, batch=2, length=17, seed=4) < 1e-4


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(rope_interleave=False), "rope_interleave false is not supported (vLLM ignores it)"),
        (dict(rope_parameters={**YARN, "truncate": False}), "yarn truncate false is not supported"),
        (dict(rope_parameters={**YARN, "rope_type": "longrope"}), "is not supported (default, or yarn"),
        (dict(topk_method="greedy"), "router ('sigmoid', 'greedy') is not supported"),
        (dict(indexer_types=["full", "shared", "full", "shared"]), "reuse another layer's top-k"),
    ],
    ids=["halves-rope", "untruncated-yarn", "longrope", "greedy-router", "shared-indexer"],
)
def test_configs_the_engines_disagree_on_or_it_cannot_run_are_refused_in_one_line(
    mla_models, tmp_path, change, message
):
    """transformers honours rope_interleave and yarn truncate, vLLM 0.32 ignores them: neither number would
    be right for both, so the runtime refuses; inspect still describes the checkpoint."""
    source = mla_models["GlmMoeDsaForCausalLM"][0]
    for item in source.iterdir():
        (tmp_path / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    result = specdoctor("generate", "--model", str(tmp_path), "--prompt", "w1 w2")
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    inspected = specdoctor("inspect", "--model", str(tmp_path), "--pp", "2", "--json", "-")  # headers still read
    assert inspected.returncode == 0 and message in json.loads(inspected.stdout)["runtime"]


def transformers_mtp_logits(path, tokens, prev_hidden, positions):
    """One MTP step by transformers: the target loaded by from_pretrained, its MtpModel loading the MTP
    layer from the checkpoint through transformers' own key conversions, and its MtpLayer running
    e = embed(token), eh_proj(cat(enorm(e), hnorm(prev))), the family's decoder layer and the shared_head
    norm, then the target's lm_head (what vLLM 0.32 shares into every MTP layer's shared_head.head)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    config = model.config
    config.num_mtp_layers = 1
    for field in ("layer_types", "mlp_layer_types", "indexer_types"):  # the MTP layer is the last layer's kind
        if getattr(config, field, None):
            setattr(config, f"mtp_{field}", getattr(config, field)[-1:])
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(model).eval()
    layer = mtp.layers[0]
    block_forward = layer.mtp_block.forward  # GLM-5's decoder layer also returns its top-k indices
    layer.mtp_block.forward = lambda *args, **kwargs: _first(block_forward(*args, **kwargs))
    length = tokens.shape[1]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]  # DSA's indexer needs it explicit
    embeds = mtp.embed_tokens(tokens)
    rotary = mtp.rotary_emb(embeds, positions)
    hidden = layer(embeds, prev_hidden, rotary, attention_mask=mask, position_ids=positions, cache=None)
    return mtp.shared_head(hidden)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_mtp_step_matches_transformers_mtp_layer(mla_models, architecture):
    """Positions from 1: vLLM zeroes the embedding at position 0, transformers does not."""
    error, provenance = mtp_step_error(*mla_models[architecture], transformers_mtp_logits, first_position=1)
    assert not provenance.unfilled() and error < 1e-4


@pytest.mark.parametrize("architecture, pp", list(zip(ARCHITECTURES, (2, 3, 4, 4), strict=True)))
def test_pipeline_matches_single_process_and_speculation_is_lossless(mla_models, architecture, pp):
    assert_pipeline_matches_single_process(*mla_models[architecture], pp, ks=(1, 3))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_check_at_pp4_finds_the_legacy_loading_only_where_the_mtp_layer_ships_no_copies(mla_models, architecture):
    """vLLM's legacy loading leaves the drafter's embedding and head unloaded on the last rank unless the
    MTP layer ships its own copies: DeepSeek's checkpoints do, GLM's do not. Where they are unloaded,
    content finds them and the repair clears them; either way the battery passes (speculation is
    lossless). The drafter is random, so acceptance is not asserted."""
    path = str(mla_models[architecture][0])
    report = run_check(check_options(path, 4, None, 3, "engine-legacy", "engine-legacy", "nan", repair=True), False)
    before = report.stages[0]
    assert before.behaviour["battery"] == "9/9"
    provenance = before.drafter["provenance"]
    if architecture in SHIPS_OWN_COPIES:
        assert before.signals()["content"] == [] and not report.repair.repaired
        assert provenance["embed_tokens.weight"] == "checkpoint:model.layers.4.embed_tokens.weight"
        return
    assert provenance["embed_tokens.weight"] == provenance["layers.4.shared_head.head.weight"] == "unfilled:nan"
    assert {"drafter.stats", "drafter.fingerprint"} <= set(before.signals()["content"])
    after = report.stages[1]
    assert report.repair.repaired and after.signals()["content"] == [] and after.behaviour["battery"] == "9/9"
