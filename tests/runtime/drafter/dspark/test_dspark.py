"""DSpark drafters in one process (docs/dspark.md): the config as vLLM 0.32 reads it, the settings refused,
the taps against transformers' own hidden states, and each loading policy with the content findings it
fires and the repair that clears them. tests/runtime/drafter/test_dspark_pipeline.py runs them across ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specdoctor.checks.drafter import drafter_findings
from specdoctor.errors import CheckpointError
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.measure import measure_drafter
from specdoctor.runtime.drafter.registry import drafter_checkpoint
from specdoctor.runtime.drafter.repair import repair_drafter
from specdoctor.runtime.models.dspark import read_dspark_config
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import build_rank
from tests.helpers.dspark import TARGET, drafter_fields, make_drafter, make_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target directory, drafter directory, the transformers target)."""
    root = tmp_path_factory.mktemp("dspark_pair")
    model = make_target(root / "target")
    make_drafter(root / "drafter")
    return root / "target", root / "drafter", model


@pytest.mark.parametrize(
    "fields, entries",
    [
        ({"target_layer_ids": [1, 3, 5]}, (2, 4, 6)),  # DSpark ids name a layer's output: vLLM's aux entry id + 1
        ({"target_layer_ids": [5, 1, 3, 3]}, (2, 4, 6)),  # sorted and de-duplicated, as vLLM sets its aux layers
        ({"target_layer_ids": None, "dflash_config": {"target_layer_ids": [0, 2]}}, (1, 3)),
        ({"target_layer_ids": None, "dspark_target_layer_ids": [2]}, (3,)),
        ({"target_layer_ids": [1], "eagle_aux_hidden_state_layer_ids": [2, 4]}, (2, 4)),  # entries already
    ],
)
def test_tap_entries_follow_vllm(fields, entries):
    config = read_dspark_config({k: v for k, v in drafter_fields(**fields).items() if v is not None})
    assert config.tap_entries == entries


@pytest.mark.parametrize(
    "fields, mask",
    [
        ({"mask_token_id": 7}, 7),
        ({"mask_token_id": 7, "dflash_config": {"mask_token_id": 9}}, 9),
        ({"mask_token_id": None, "dspark_noise_token_id": 5}, 5),
    ],
)
def test_mask_token_is_looked_up_as_vllm_does(fields, mask):
    assert (
        read_dspark_config({k: v for k, v in drafter_fields(**fields).items() if v is not None}).mask_token_id == mask
    )


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"is_causal": True}, "causal draft layers"),
        ({"dflash_config": {"causal": True}}, "causal draft layers"),
        ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}, "sliding-window"),
        ({"sample_from_anchor": False}, "sample_from_anchor false"),
        ({"draft_vocab_size": 100}, "reduced draft vocabulary"),
        ({"attention_bias": True}, "attention_bias"),
        ({"markov_head_type": "gated"}, "markov_head_type 'gated'"),
        ({"markov_rank": 0}, "markov_rank must be positive"),
        ({"target_layer_ids": []}, "needs target_layer_ids"),
        ({"mask_token_id": None}, "needs mask_token_id"),
        ({"mask_token_id": TARGET["vocab_size"]}, "outside the vocabulary"),
        ({"architectures": ["LlamaForCausalLM"]}, "not a DSpark drafter"),
    ],
)
def test_settings_the_runtime_does_not_run_are_refused(fields, reason):
    with pytest.raises(CheckpointError, match=reason):
        read_dspark_config({k: v for k, v in drafter_fields(**fields).items() if v is not None})


def test_taps_are_the_residual_stream_transformers_reports(pair):
    """Entry j (what vLLM captures after layer j - 1) is transformers' hidden_states[j] for every layer but
    the last, whose transformers entry is after the final norm (vLLM's tap of it is before the norm)."""
    target_path, _, model = pair
    layers = TARGET["num_hidden_layers"]
    rank, _ = build_rank(RuntimeOptions(str(target_path), tp=1), 0)
    rank.stage.tap_entries = tuple(range(layers + 1))
    ids = torch.randint(0, TARGET["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True).hidden_states
        _, taps = rank.stage.forward_with_taps(ids, torch.arange(11).expand(2, -1))
    assert sorted(taps) == list(range(layers + 1))
    for entry in range(layers):
        torch.testing.assert_close(taps[entry], expected[entry], rtol=1e-5, atol=1e-5)
    final = rank.stage.model.norm(taps[layers])
    torch.testing.assert_close(final, expected[layers], rtol=1e-5, atol=1e-5)


def last_rank(pair, pp: int = 2, **policies):
    target_path, drafter_path, _ = pair
    options = RuntimeOptions(str(target_path), pp=pp, speculative_model=str(drafter_path), **policies)
    return build_rank(options, pp - 1)[0]


@pytest.mark.parametrize(
    "pp, policies, broken, signals",
    [
        (2, dict(drafter_policy="engine-legacy", fill="zeros"), ["embed_tokens.weight"], {"stats", "fingerprint"}),
        (3, dict(drafter_policy="engine-legacy", fill="stale"), ["embed_tokens.weight"], {"fingerprint"}),
        (2, dict(head_policy="unloaded", fill="nan"), ["lm_head.weight"], {"stats", "fingerprint"}),
        (
            2,
            dict(markov_policy="unloaded", fill="zeros"),
            ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"],
            {"stats", "fingerprint"},
        ),
    ],
)
def test_each_unloaded_tensor_is_found_from_its_content_and_repaired(pair, pp, policies, broken, signals):
    model = last_rank(pair, pp, **policies)
    findings, by_tp_rank = drafter_findings(measure_drafter(model), "before")
    found = by_tp_rank[0]  # TP 1: rank 0 alone
    assert found == broken
    errors = {f.check.removeprefix("drafter.") for f in findings if f.severity == "error" and f.data.get("name")}
    assert errors == signals
    result = repair_drafter(model, found)
    assert set(result.repaired) == set(broken)
    findings, by_tp_rank = drafter_findings(measure_drafter(model), "after")
    found = by_tp_rank[0]  # TP 1: rank 0 alone
    assert found == [] and not [f for f in findings if f.severity == "error"]
    target, drafter = Checkpoint(pair[0]), drafter_checkpoint(pair[1])
    for name, key in result.repaired.items():
        source = drafter if name.startswith("markov_head.") else target
        torch.testing.assert_close(model.drafter.get_parameter(name), source.read(key))


@pytest.mark.parametrize(
    "pp, policy, provenance",
    [
        (1, "engine-legacy", "alias:model.embed_tokens"),  # PP 1: the target's, shared where it lives
        (2, "fixed", "checkpoint:model.embed_tokens.weight"),  # PP > 1: the one tensor read from the target
        (2, "alias-placeholder", "placeholder:model.embed_tokens"),
    ],
)
def test_embedding_policies(pair, pp, policy, provenance):
    model = last_rank(pair, pp, drafter_policy=policy)
    assert model.provenance.labels()["embed_tokens.weight"] == provenance
    assert model.provenance.labels()["lm_head.weight"] == "alias:lm_head"  # the drafter's rank holds the head
    findings, by_tp_rank = drafter_findings(measure_drafter(model), "before")
    broken = by_tp_rank[0]  # TP 1: rank 0 alone
    if policy == "alias-placeholder":
        assert broken == ["embed_tokens.weight"]
        assert any(f.check == "drafter.alias" and "token ids" in f.message for f in findings)
    else:
        assert broken == []


def test_a_shipped_embedding_is_the_drafters_own(pair, tmp_path):
    """A drafter that ships embed_tokens keeps it at any PP size (vLLM's has_own_embed_tokens)."""
    import shutil

    from safetensors.torch import save_file

    drafter = tmp_path / "drafter"
    shutil.copytree(pair[1], drafter)
    own = torch.randn(TARGET["vocab_size"], TARGET["hidden_size"], generator=torch.Generator().manual_seed(9))
    save_file({"embed_tokens.weight": own}, str(drafter / "embed.safetensors"))
    index = json.loads((drafter / "model.safetensors.index.json").read_text())
    index["weight_map"]["embed_tokens.weight"] = "embed.safetensors"
    (drafter / "model.safetensors.index.json").write_text(json.dumps(index))
    model = last_rank((pair[0], drafter, None), 2, drafter_policy="engine-legacy")
    assert model.provenance.labels()["embed_tokens.weight"] == "checkpoint:embed_tokens.weight"
    torch.testing.assert_close(model.drafter.embed_tokens.weight, own)
    assert drafter_findings(measure_drafter(model), "before")[1] == {0: []}


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"vocab_size": TARGET["vocab_size"] + 64, "mask_token_id": 3}, "vocab_size"),
        ({"target_hidden_size": 32}, "target_hidden_size 32"),
        ({"target_layer_ids": [1, 6]}, r"target_layer_ids \[6\] lie outside"),
    ],
)
def test_a_drafter_that_cannot_draft_for_the_target_is_refused(pair, tmp_path, fields, problem):
    from specdoctor.runtime.engine import Engine
    from specdoctor.workflow.check import CheckOptions, run_check

    make_drafter(tmp_path / "drafter", **fields)
    options = RuntimeOptions(str(pair[0]), pp=2, speculative_model=str(tmp_path / "drafter"))
    with pytest.raises(CheckpointError, match=problem):
        Engine(options)
    report = run_check(CheckOptions(dataclasses.replace(options, num_speculative_tokens=None)), show_progress=False)
    assert [f.check for f in report.preflight if f.severity == "error"] == ["dspark.pairing", "runtime.skipped"]
    assert report.stages == [] and report.exit_code == 1
    assert any(f.check == "runtime.skipped" for f in report.preflight)
