"""The EAGLE-3 kind in the pipeline runtime, on heads speculators wrote for a Llama target transformers saved:
lossless at PP 1-4 in both layouts, each engine failure of issue #29 found by `check` (content, the tap
probe) and repaired where a checkpoint read fixes it, the pre-flight's reading of the heads, and heads that do
not fit their target refused in one line before any rank starts.

The heads are untrained (acceptance near 0 whatever the loading), so a fault is asserted through the signal
that names it, not through acceptance: demo-eagle3's trained head carries the behaviour gate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.drafter_runs import (
    drafter_options,
    plain_tokens_of,
    preflight_by_check,
    repaired_check,
    speculative_run,
)

pytestmark = pytest.mark.tool_env("speculators")  # installed before the tests start (tests/conftest.py)


@pytest.fixture(scope="module")
def plain_tokens(eagle3_target):
    return plain_tokens_of(eagle3_target)


@pytest.mark.parametrize(
    "head_fixture, pp, k",
    [
        ("pruned_head", 1, 3),
        ("pruned_head", 4, 5),
        ("shared_head", 2, 4),
        ("original_head", 3, 2),
        ("qwen3_head", 2, 3),
    ],
)
def test_speculative_decoding_is_lossless_at_every_pp(request, eagle3_target, plain_tokens, head_fixture, pp, k):
    assert speculative_run(eagle3_target, request.getfixturevalue(head_fixture), pp, k).tokens == plain_tokens


# name: (head, loading, the check that names it at PP > 1, the drafter tensor a checkpoint read repairs or None
# for a wiring fault, whether PP 1 shows it too)
FAULTS = {
    # vLLM 0.32's EAGLE proposer never shares the target's embedding at PP > 1 (vllm#46994 class)
    "embedding-unshared": ("shared_head", dict(drafter_policy="engine-legacy", fill="nan"), "drafter.fingerprint",
                           "embed_tokens.weight", False),
    "embedding-placeholder": ("shared_head", dict(drafter_policy="alias-placeholder"), "drafter.alias",
                              "embed_tokens.weight", False),
    "target-head-over-pruned": ("pruned_head", dict(head_policy="target"), "drafter.fingerprint", "lm_head.weight",
                                True),
    # a head that needs the target's lm_head run with its own, which it does not ship (local-inference-lab vllm#54)
    "own-head-where-target-needed": ("shared_head", dict(head_policy="unloaded", fill="zeros"), "drafter.fingerprint",
                                     "lm_head.weight", True),
    "d2t-ignored": ("pruned_head", dict(d2t_policy="ignored"), "drafter.fingerprint", "d2t", True),
    "aux-off-by-one": ("pruned_head", dict(tap_policy="off-by-one"), "drafter.taps", None, True),
    "aux-engine-default": ("pruned_head", dict(tap_policy="engine-default"), "drafter.taps", None, True),
}  # fmt: skip


def drafter_errors(stage) -> set[str]:
    return {f.check for f in stage.findings if f.severity == "error" and f.check.startswith("drafter.")}


@pytest.mark.parametrize("pp", [1, 4])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_is_found_and_repaired_or_reported(request, eagle3_target, fault, pp):
    head_fixture, loading, signal, tensor, at_pp1 = FAULTS[fault]
    head = request.getfixturevalue(head_fixture)
    # short battery answers: the untrained heads' verdicts rest on content and taps
    report = repaired_check(eagle3_target, head, 8, pp=pp, **loading)
    before = report.stages[0]
    # The output stays right (the failure is silent), except where the engine's first draft step fails on the
    # token ids a placeholder hands back, as vLLM's does.
    assert before.behaviour["battery"] == ("crashed" if fault == "embedding-placeholder" and pp > 1 else "9/9")
    if pp == 1 and not at_pp1:  # the target's embedding lives on the drafter's rank: engines share it
        assert drafter_errors(before) == set() and report.repair.repaired == {}
        return
    assert signal in drafter_errors(before), before.findings
    if tensor is None:  # wiring: no checkpoint read fixes it, and the verdict says which state is wrong
        assert report.repair.repaired == {} and len(report.stages) == 1 and report.exit_code == 1
        assert report.verdict().split(": ", 1)[1].startswith("the tap of target layer")
    else:
        assert tensor in report.repair.repaired
        after = report.stages[1]
        assert drafter_errors(after) == set() and after.behaviour["battery"] == "9/9", after.findings


def test_preflight_warns_where_the_engine_guesses_the_aux_layers(eagle3_target, original_head, pruned_head):
    guessed = preflight_by_check(eagle3_target, original_head, 2)
    warning = guessed["eagle3.aux_ids"][0]
    assert warning.severity == "warning" and "entering layers [2, 4, 5] of 8" in warning.message
    assert "original layout" in guessed["eagle3.config"][0].message
    named = preflight_by_check(eagle3_target, pruned_head, 4)
    assert "eagle3.aux_ids" not in named and "draft vocabulary 200 of 320" in named["eagle3.config"][0].message
    taps = named["placement.taps"][0]  # aux entries 1, 3, 6 of 8 layers over 4 ranks: two travel
    assert taps.severity == "warning" and taps.data["owners"] == {0: 0, 2: 1, 5: 2}


def test_preflight_names_an_embedding_the_drafters_rank_lacks(eagle3_target, shared_head):
    findings = preflight_by_check(eagle3_target, shared_head, 4)
    assert "never shares it at PP > 1" in findings["placement.drafter_embedding"][0].hint
    assert "embedding: the target's, head: the target's" in findings["eagle3.tensors"][0].message
    assert "placement.drafter_embedding" not in preflight_by_check(eagle3_target, shared_head, 1)
    assert "placement.aux_relay" not in findings  # vLLM's Llama relays aux states between ranks


def test_preflight_warns_where_vllm_relays_no_aux_states():
    """vLLM 0.32 refuses EAGLE-3 at PP > 1 beside a target whose model does not relay them (GLM-4.5 here)."""
    from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS, DEMO_MODELS

    head = DEMO_DRAFTERS["demo-eagle3"]
    assert "refuses the EAGLE-3 head at PP 2 beside Glm4MoeForCausalLM" in (
        preflight_by_check(DEMO_MODELS["demo"], head, 2)["placement.aux_relay"][0].message
    )
    assert "placement.aux_relay" not in preflight_by_check(DEMO_MODELS["demo"], head, 1)


def edited_head(source, out, config_edit=None, drop=()):
    """A copy of `source` with its config edited and tensors dropped (or, "d2t-past-vocabulary", its d2t
    offset past the last target id)."""
    from safetensors.torch import load_file, save_file

    from tests.helpers.eagle3 import without_tensors

    head = without_tensors(source, out, *([] if isinstance(drop, str) else drop))
    if drop == "d2t-past-vocabulary":
        tensors = load_file(str(head / "model.safetensors"))
        tensors["d2t"][-1] += 1000
        save_file(tensors, str(head / "model.safetensors"))
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(config_edit(config) if config_edit else config))
    return head


def with_layer(config, **fields):
    return {**config, "transformer_layer_config": {**config["transformer_layer_config"], **fields}}


@pytest.mark.parametrize(
    "config_edit, drop, message",
    [
        (lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [1, 3, 9]}, (), "aux layer ids [9] lie outside"),
        (lambda c: {**c, "target_hidden_size": 96}, (), "target_hidden_size 96 is not the target's 64"),
        (lambda c: with_layer(c, vocab_size=512), (), "vocab_size 512 differs from the target's 320"),
        (lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [1, 6]}, (), "vLLM builds its fc for 3 aux states"),
        (
            lambda c: {**with_layer(c, num_aux_hidden_states=2), "eagle_aux_hidden_state_layer_ids": [1, 6]},
            (),
            "fc.weight takes 192 inputs",
        ),
        (
            lambda c: {**with_layer(c, hidden_size=96, head_dim=24), "target_hidden_size": 64},
            ("embed_tokens.weight",),
            "its hidden size 96 is not the target's 64 and it ships no embed_tokens.weight",
        ),
        (
            lambda c: {
                **c,
                "logit_scale": "large",
                "transformer_layer_config": {**c["transformer_layer_config"], "logit_scale": "large"},
            },
            (),
            "'logit_scale' must be a number",
        ),
        (None, ("lm_head.weight",), "ships no lm_head.weight of its own"),
        (None, ("d2t",), "ships no d2t"),
        (None, "d2t-past-vocabulary", "d2t maps draft ids to target ids outside the vocabulary"),
        (None, ("fc.weight",), "has no fc.weight"),
        (lambda c: with_layer(c, model_type="deepseek_v3"), (), "not model_type 'deepseek_v3'"),
    ],
    ids=[
        "aux-past-layers",
        "hidden-size",
        "vocabulary",
        "aux-count",
        "fc-width",
        "narrower-unshared",
        "logit-scale-text",
        "no-head",
        "no-d2t",
        "bad-d2t",
        "no-fc",
        "deepseek-layer",
    ],  # fmt: skip
)
def test_a_head_that_does_not_fit_is_refused_in_one_line(tmp_path, eagle3_target, pruned_head, config_edit, drop,
                                                         message):  # fmt: skip
    """The runtime refuses it before any rank starts; the pre-flight reports it as an error, where the headers
    tell (a config the reader refuses, or a d2t read beyond them, is refused there too)."""
    from specdoctor.errors import CheckpointError
    from specdoctor.runtime.engine import Engine

    head = edited_head(pruned_head, tmp_path / "head", config_edit, drop)
    before = {path.name: path.read_bytes() for path in head.iterdir()}
    with pytest.raises(CheckpointError) as refused:
        Engine(drafter_options(eagle3_target, head))
    assert message in str(refused.value) and "\n" not in str(refused.value)
    if any(word in message for word in ("model_type", "must be")):
        with pytest.raises(CheckpointError, match=message):
            preflight_by_check(eagle3_target, head, 1)
    elif "d2t maps" not in message:
        assert any(message in f.message for f in preflight_by_check(eagle3_target, head, 1).get("eagle3.pairing", []))
    assert {path.name: path.read_bytes() for path in head.iterdir()} == before  # nothing written to the head


@pytest.mark.parametrize("edit, code", [("aux-past-layers", 1), ("deepseek-layer", 2)])
def test_check_reports_a_misfit_head_from_the_command_line(tmp_path, eagle3_target, pruned_head, edit, code):
    """A head the pre-flight can describe: exit 1 with its error finding; one it cannot read: exit 2, one line."""
    edits = {
        "aux-past-layers": lambda c: {**c, "eagle_aux_hidden_state_layer_ids": [1, 3, 9]},
        "deepseek-layer": lambda c: with_layer(c, model_type="deepseek_v3"),
    }
    head = edited_head(pruned_head, tmp_path / "head", edits[edit])
    check = specdoctor("check", "--model", str(eagle3_target), "--speculative-model", str(head), "--json", "-")
    assert check.returncode == code, check.stderr
    if code == 2:
        assert "not model_type 'deepseek_v3'" in check.stderr and len(check.stderr.strip().splitlines()) == 1
    else:
        errors = [f["message"] for f in json.loads(check.stdout)["preflight"] if f["severity"] == "error"]
        assert any("aux layer ids [9] lie outside" in message for message in errors)


def specdoctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdoctor", *args], capture_output=True, text=True, timeout=120)


def test_speculative_config_names_an_eagle3_head(eagle3_target, pruned_head):
    from specdoctor.runtime.drafter.registry import options_from_speculative_config

    fields = options_from_speculative_config(
        json.dumps({"method": "eagle3", "model": str(pruned_head), "num_speculative_tokens": 4})
    )
    assert fields == {
        "num_speculative_tokens": 4,
        "speculative_method": "eagle3",
        "speculative_model": str(pruned_head),
    }


def test_a_speculators_head_proposes_its_own_default_k(eagle3_target, pruned_head):
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import drafter_kind, speculative_tokens

    kind = drafter_kind(Checkpoint(eagle3_target), str(eagle3_target), str(pruned_head))
    assert speculative_tokens(kind, None) == 5  # speculators_config's proposal, written by its training tool


def test_an_engine_default_that_collapses_is_refused_before_any_rank_starts():
    """On 6 layers vLLM's default (2, 3, 3) captures two states where the drafter's fc reads three."""
    from specdoctor.errors import SpecdoctorError
    from specdoctor.runtime.engine import Engine
    from specdoctor.runtime.options import RuntimeOptions

    with pytest.raises(SpecdoctorError, match=r"capture 2 distinct states \[2, 3\] of this 6-layer target"):
        Engine(RuntimeOptions("demo-dspark", tap_policy="engine-default"))


def test_vllm_reads_a_plain_llama_config_named_by_method_eagle3_as_a_head(tmp_path, eagle3_target, original_head):
    """Some heads ship `architectures: ["LlamaForCausalLM"]`: vLLM's EAGLEConfig takes them as EAGLE-3 heads when
    the method says eagle3; without one the runtime reads a Llama config as a draft model."""
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import drafter_kind

    head = edited_head(original_head, tmp_path / "head", lambda c: {**c, "architectures": ["LlamaForCausalLM"]})
    target = Checkpoint(eagle3_target)
    assert drafter_kind(target, str(eagle3_target), str(head), "eagle3").name == "eagle3"
    assert drafter_kind(target, str(eagle3_target), str(head)).name == "draft_model"


def test_a_qwen3_head_sizes_its_fc_by_vllms_qwen3_rule(qwen3_head):
    """vLLM's Qwen3 EAGLE-3 model sizes fc from the config's own aux id list where no count is given; its Llama
    model from eagle_config's ids only, else 3."""
    from specdoctor.runtime.models.eagle3 import read_eagle3_config

    config = json.loads((qwen3_head / "config.json").read_text())
    layer = {
        k: v
        for k, v in config["transformer_layer_config"].items()
        if k not in ("num_aux_hidden_states", "eagle_config")
    }
    four = {**config, "transformer_layer_config": layer, "eagle_aux_hidden_state_layer_ids": [1, 2, 3, 6]}
    assert read_eagle3_config(four).num_aux == 4
    assert read_eagle3_config(with_layer(four, model_type="llama")).num_aux == 3
    assert read_eagle3_config(with_layer(four, num_aux_layers=2)).num_aux == 2
