"""Header-only commands on every architecture vLLM 0.32 registers an MTP drafter for: transformers-made
checkpoints are described by inspect and judged by check's pre-flight whether or not the runtime runs
them; for those it does not, check skips the runtime stages with a warning and the exit code rests on the
pre-flight."""

from __future__ import annotations

import json

import pytest

from specdoctor.runtime.architectures import ARCHITECTURES
from specdoctor.runtime.models.registry import FAMILIES as RUNTIME_FAMILIES
from tests.commands.test_check import specdoctor
from tests.commands.test_cli import rename_key
from tests.helpers.families import FAMILIES, SHIPS_OWN_COPIES, make_family_checkpoint


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    made = {}
    for name in FAMILIES:
        path = tmp_path_factory.mktemp(name)
        make_family_checkpoint(path, name)
        made[name] = path
    return made


@pytest.mark.parametrize("architecture", list(FAMILIES))
def test_inspect_describes_the_mtp_layer_placement_and_hazards(family_dirs, architecture):
    result = specdoctor("inspect", "--model", str(family_dirs[architecture]), "--pp", "2", "--json", "-")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    layout = ARCHITECTURES[architecture].mtp
    assert summary["architecture"] == architecture and summary["mtp_layout"] == layout.name
    runs = architecture in RUNTIME_FAMILIES
    assert (
        summary["runtime"] == "runs"
        if runs
        else summary["runtime"].startswith(f"the runtime does not run {architecture}")
    )
    [layer] = summary["mtp_layers"]
    assert layer["prefix"] == layout.prefix(4 if layout.numbered_after_target else 0)
    # GLM-5 and GLM-4.7-Flash ship no own head: inspect lists it missing, the pre-flight warns (the target's serves)
    own_head = layout.own_head and architecture not in SHIPS_OWN_COPIES
    assert layer["missing"] == ([layer["prefix"] + layout.own_head] if own_head else [])
    assert len(layer["tensors"]) > len(layout.layer_keys)
    assert all(info is not None for info in summary["mtp_shared_tensors"].values())
    assert [rank["has_drafter"] for rank in summary["placement"]] == [False, True]
    own_copy = layout.prefix(4) + "embed_tokens.weight"
    expected = own_copy if architecture in SHIPS_OWN_COPIES else "model.embed_tokens.weight"
    assert summary["draft_embedding"]["key"] == expected
    checks = {finding["check"] for finding in summary["preflight"]}
    assert {"config", "mtp.tensors", "embedding.source"} <= checks
    assert ("mtp.shared_head" in checks) == bool(own_head)
    # the last rank lacks the drafter's embedding unless the MTP layer ships its own copy
    assert ("placement.drafter_embedding" in checks) == (architecture not in SHIPS_OWN_COPIES)


@pytest.mark.parametrize("architecture", [name for name in FAMILIES if name not in RUNTIME_FAMILIES])
def test_check_runs_the_preflight_and_says_why_the_runtime_stages_are_skipped(family_dirs, architecture):
    result = specdoctor("check", "--model", str(family_dirs[architecture]), "--pp", "2", "--json", "-")
    report = json.loads(result.stdout)
    # What was not run was not verified: never healthy, never exit 0.
    assert result.returncode == report["verdict"]["exit_code"] == 1, result.stdout
    assert report["stages"] == [] and not report["verdict"]["healthy"]
    skipped = [f for f in report["preflight"] if f["check"] == "runtime.skipped"]
    assert [f["severity"] for f in skipped] == ["error"] and f"does not run {architecture}" in skipped[0]["message"]
    summary = report["verdict"]["summary"]
    assert summary.startswith("not verified: checked pre-flight; not run: the loaded-drafter and behaviour stages: ")


def test_a_missing_mtp_tensor_of_another_layout_is_a_preflight_error(tmp_path):
    make_family_checkpoint(tmp_path, "Qwen3_5MoeForCausalLM")
    rename_key(tmp_path, "mtp.pre_fc_norm_hidden.weight", None)
    result = specdoctor("check", "--model", str(tmp_path), "--json", "-")
    assert result.returncode == 1
    preflight = json.loads(result.stdout)["preflight"]  # the runtime runs this family: its stages report too
    errors = [f for f in preflight if f["severity"] == "error"]
    assert [f["check"] for f in errors] == ["mtp.tensors"] and "mtp.pre_fc_norm_hidden.weight" in errors[0]["message"]


def test_the_runtime_refuses_an_architecture_it_does_not_run_in_one_line(family_dirs):
    result = specdoctor("generate", "--model", str(family_dirs["MiMoV2FlashForCausalLM"]), "--prompt", "x")
    assert result.returncode == 2 and "does not run MiMoV2FlashForCausalLM yet" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_an_unknown_architecture_is_still_a_clear_error(tmp_path):
    make_family_checkpoint(tmp_path, "Qwen3_5ForCausalLM")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma3ForCausalLM"]}))
    result = specdoctor("inspect", "--model", str(tmp_path))
    assert result.returncode == 2 and "its MTP layout is unknown" in result.stderr
