"""`specdoctor inspect` run as a real process: human output, JSON, and bad usage."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from specdoctor.runtime.checkpoint.reader import Checkpoint
from tests.conftest import make_hf_checkpoint


def specdoctor(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"COLUMNS": "200"}  # a wide terminal, so table cells are not folded
    return subprocess.run([sys.executable, "-m", "specdoctor", *args], capture_output=True, text=True, env=env)


def test_inspect_demo_human_output():
    result = specdoctor("inspect", "--model", "demo")
    assert result.returncode == 0, result.stderr
    for text in (
        "Glm4MoeForCausalLM",
        "model.embed_tokens.weight",
        "model.layers.4.eh_proj.weight",
        "Draft embedding source",
    ):
        assert text in result.stdout


def test_inspect_demo_json_agrees_with_the_headers():
    result = specdoctor("inspect", "--model", "demo", "--json", "-")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    checkpoint = Checkpoint("demo")
    assert summary["num_keys"] == len(checkpoint.tensors)
    assert summary["total_bytes"] == sum(t.nbytes for t in checkpoint.tensors.values())
    assert summary["layout"] == "index" and summary["num_shards"] >= 2
    assert summary["embedding"]["key"] == "model.embed_tokens.weight"
    assert summary["draft_embedding"]["key"] == "model.embed_tokens.weight"
    assert [layer["layer"] for layer in summary["mtp_layers"]] == [4]
    assert summary["mtp_layers"][0]["missing"] == []


def test_inspect_takes_the_drafter_flags_every_runtime_command_takes():
    """--speculative-config as vLLM spells it (its method checked against the checkpoint), --speculative-method."""
    from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS

    head = str(DEMO_DRAFTERS["demo-eagle3"])
    config = json.dumps({"method": "eagle3", "model": head, "num_speculative_tokens": 3})
    result = specdoctor("inspect", "--model", "demo-eagle3", "--speculative-config", config, "--json", "-")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["schema"] == "specdoctor.inspect/2" and summary["drafter_checkpoint"]["path"] == head
    wrong = specdoctor("inspect", "--model", "demo-eagle3", "--speculative-method", "dspark")
    assert wrong.returncode == 2 and "not method 'dspark'" in wrong.stderr


@pytest.fixture
def tiny(tmp_path):
    make_hf_checkpoint(tmp_path, seed=11, num_hidden_layers=2, n_routed_experts=4, n_group=2, topk_group=1)
    return tmp_path


def rename_key(path, old: str, new: str | None) -> None:
    """Rewrite the shard holding `old` with the tensor under `new` (or dropped) and fix the index."""
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop(old)
    tensors = load_file(str(path / shard))
    value = tensors.pop(old)
    if new is not None:
        tensors[new] = value
        index["weight_map"][new] = shard
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_inspect_reports_missing_mtp_tensor(tiny):
    rename_key(tiny, "model.layers.2.eh_proj.weight", None)
    summary = json.loads(specdoctor("inspect", "--model", str(tiny), "--json", "-").stdout)
    assert summary["mtp_layers"][0]["missing"] == ["model.layers.2.eh_proj.weight"]


def test_inspect_finds_embedding_under_language_model_prefix(tiny):
    rename_key(tiny, "model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    summary = json.loads(specdoctor("inspect", "--model", str(tiny), "--json", "-").stdout)
    # The target's embedding is found under the multimodal prefix, and it is what the drafter reads.
    assert summary["embedding"]["key"] == "model.language_model.embed_tokens.weight"
    assert summary["draft_embedding"]["key"] == "model.language_model.embed_tokens.weight"


def test_inspect_reports_no_draft_embedding_source(tiny):
    rename_key(tiny, "model.embed_tokens.weight", None)
    result = specdoctor("inspect", "--model", str(tiny))
    assert result.returncode == 0
    assert "none of the candidate keys" in result.stdout.replace("\n", " ")


def test_unsupported_architecture_is_a_clear_error(tiny):
    config = json.loads((tiny / "config.json").read_text())
    config["architectures"] = ["Gemma3ForCausalLM"]
    (tiny / "config.json").write_text(json.dumps(config))
    result = specdoctor("inspect", "--model", str(tiny))
    assert result.returncode == 2
    assert "architecture 'Gemma3ForCausalLM' is not supported" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [("inspect",), ("inspect", "--model", "demo", "--bogus"), ("frobnicate",)])
def test_bad_usage_exits_2_without_traceback(args):
    result = specdoctor(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.strip()


def test_demo_is_found_from_any_working_directory(tmp_path):
    shutil.rmtree(tmp_path)
    tmp_path.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "specdoctor", "inspect", "--model", "demo", "--json", "-"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0 and json.loads(result.stdout)["architecture"] == "Glm4MoeForCausalLM"
