"""The checkpoint reader: layouts, header-only metadata, single-tensor reads, and every rejection."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specdoctor.errors import CheckpointError
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.mtp import embedding_candidates
from tests.conftest import make_hf_checkpoint

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine")
    make_hf_checkpoint(path, seed=3, num_hidden_layers=2, n_routed_experts=4, n_group=2, topk_group=1)
    return path


@pytest.fixture
def copy(pristine, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(pristine, target)
    return target


def safetensors_keys(path: Path) -> dict[str, tuple]:
    found = {}
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():
                found[key] = (shard.name, tuple(handle.get_slice(key).get_shape()))
    return found


def test_index_layout_gives_every_key_shard_dtype_and_shape(pristine):
    checkpoint = Checkpoint(pristine)
    truth = safetensors_keys(pristine)
    assert checkpoint.layout == "index"
    assert {k: (t.shard, t.shape) for k, t in checkpoint.tensors.items()} == truth
    assert {t.dtype for t in checkpoint.tensors.values()} == {"F32"}
    assert checkpoint.keys_read == [] and checkpoint.bytes_read == 0  # opening reads headers only


def test_shards_without_index_are_scanned(copy):
    (copy / INDEX).unlink()
    checkpoint = Checkpoint(copy)
    assert checkpoint.layout == "shards"
    assert set(checkpoint.tensors) == set(safetensors_keys(copy))


def test_single_file_layout(tmp_path):
    make_hf_checkpoint(tmp_path, seed=4, shard_size="50MB", num_nextn_predict_layers=0)
    checkpoint = Checkpoint(tmp_path)
    assert checkpoint.layout == "single"
    assert {t.shard for t in checkpoint.tensors.values()} == {"model.safetensors"}
    embedding = checkpoint.read("model.embed_tokens.weight")
    assert embedding.shape == (320, 64)


def test_read_one_tensor_and_a_row_slice_moves_only_those_bytes(pristine):
    checkpoint = Checkpoint(pristine)
    info = checkpoint.tensors["model.embed_tokens.weight"]
    with safe_open(str(pristine / info.shard), framework="pt") as handle:
        truth = handle.get_tensor(info.key)
    whole = checkpoint.read(info.key)
    torch.testing.assert_close(whole, truth, rtol=0, atol=0)
    assert checkpoint.bytes_read == info.nbytes
    rows = checkpoint.read(info.key, rows=(40, 72))
    torch.testing.assert_close(rows, truth[40:72], rtol=0, atol=0)
    assert checkpoint.bytes_read == info.nbytes + 32 * 64 * 4
    assert checkpoint.keys_read == [info.key, info.key]
    with pytest.raises(CheckpointError, match="outside"):
        checkpoint.read(info.key, rows=(300, 400))


def test_every_safetensors_dtype_reads_back_exactly_as_safetensors_loads_it(tmp_path):
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {
        str(dtype): (torch.randn(5, 3, generator=generator) * 50).to(dtype)
        for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
        + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
    }
    tensors["scalar"], tensors["empty"] = torch.tensor(3.5), torch.zeros(0, 4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(Path(__file__).resolve().parents[3] / "specdoctor" / "demo_model" / "config.json", tmp_path)
    checkpoint, truth = Checkpoint(tmp_path), load_file(str(tmp_path / "model.safetensors"))
    for key, expected in truth.items():
        ours = checkpoint.read(key)
        assert ours.dtype == expected.dtype and ours.shape == expected.shape, key
        assert torch.equal(ours.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), key
    assert torch.equal(checkpoint.read("torch.int16", rows=(1, 4)), truth["torch.int16"][1:4])
    # Into a waiting tensor: bytes straight into it when the dtype matches, else converted.
    same, wider = torch.empty(5, 3, dtype=torch.bfloat16), torch.empty(5, 3, dtype=torch.float32)
    assert checkpoint.read("torch.bfloat16", out=same) is same and torch.equal(same, truth["torch.bfloat16"])
    checkpoint.read("torch.bfloat16", out=wider)
    assert torch.equal(wider, truth["torch.bfloat16"].float())


def test_a_shard_cut_short_after_opening_is_a_clear_error(copy):
    checkpoint = Checkpoint(copy)
    info = checkpoint.tensors["model.embed_tokens.weight"]
    with open(copy / info.shard, "r+b") as handle:
        handle.truncate(info.offset + 10)
    with pytest.raises(CheckpointError, match="truncated shard"):
        checkpoint.read(info.key)


def test_first_present_candidate_follows_the_documented_order(copy):
    checkpoint = Checkpoint(copy)
    candidates = embedding_candidates(checkpoint.config)
    # The MTP layer's own copy first (where shipped it is what the drafter must hold), then the target's keys.
    assert candidates[:3] == [
        "model.layers.2.embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
        "model.embed_tokens.weight",
    ]
    assert checkpoint.first_present(candidates) == "model.embed_tokens.weight"
    assert checkpoint.first_present(["nope", "lm_head.weight"]) == "lm_head.weight"
    assert checkpoint.first_present(["nope"]) is None


def corrupt(path: Path, case: str) -> str:
    """Damage a copy of a checkpoint one way; return the text the error must contain."""
    index = json.loads((path / INDEX).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    if case == "missing directory":
        shutil.rmtree(path)
        return "model directory not found"
    if case == "missing config":
        (path / "config.json").unlink()
        return "config.json not found"
    if case == "invalid config json":
        (path / "config.json").write_text('{"vocab_size": 320,')
        return "not valid JSON"
    if case == "config missing a field":
        config = json.loads((path / "config.json").read_text())
        del config["hidden_size"]
        (path / "config.json").write_text(json.dumps(config))
        return "missing required field 'hidden_size'"
    if case == "invalid index json":
        (path / INDEX).write_text("{ not json")
        return "not valid JSON"
    if case == "index names a missing shard":
        index["weight_map"]["lm_head.weight"] = "model-99999-of-99999.safetensors"
        (path / INDEX).write_text(json.dumps(index))
        return "does not exist"
    if case == "index shard outside the directory":
        shutil.copy(path / shard, path.parent / "outside.safetensors")
        index["weight_map"] = {
            k: ("../outside.safetensors" if v == shard else v) for k, v in index["weight_map"].items()
        }
        (path / INDEX).write_text(json.dumps(index))
        return "outside the model directory"
    if case == "truncated shard":
        data = (path / shard).read_bytes()
        (path / shard).write_bytes(data[: len(data) - 100])
        return "truncated shard"
    if case == "corrupt shard header":
        data = bytearray((path / shard).read_bytes())
        data[8:40] = b"\xff" * 32
        (path / shard).write_bytes(bytes(data))
        return "corrupt safetensors header"
    if case == "key in index but not in its shard":
        index["weight_map"]["model.layers.0.mlp.ghost.weight"] = shard
        (path / INDEX).write_text(json.dumps(index))
        return "is listed in"
    raise AssertionError(case)


CASES = [
    "missing directory",
    "missing config",
    "invalid config json",
    "config missing a field",
    "invalid index json",
    "index names a missing shard",
    "index shard outside the directory",
    "truncated shard",
    "corrupt shard header",
    "key in index but not in its shard",
]


def fingerprint(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())} if path.exists() else {}


@pytest.mark.parametrize("case", CASES)
def test_damaged_checkpoint_is_rejected_with_a_clear_error(copy, case):
    expected = corrupt(copy, case)
    with pytest.raises(CheckpointError, match=expected.replace("(", r"\(")) as caught:
        Checkpoint(copy)
    assert str(copy) in str(caught.value) or case == "missing directory"


@pytest.mark.parametrize("case", CASES)
def test_cli_reports_damage_in_one_line_with_exit_2_and_writes_nothing(copy, case):
    expected = corrupt(copy, case)
    before = fingerprint(copy)
    result = subprocess.run(
        [sys.executable, "-m", "specdoctor", "inspect", "--model", str(copy)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdoctor: error: ") and expected in lines[0]
    assert "Traceback" not in result.stderr
    assert fingerprint(copy) == before


def test_shape_mismatch_is_an_error_naming_the_tensor(copy):
    from specdoctor.runtime.checkpoint.loader import load_target_stage

    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] = 100
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.0\.mlp\.gate_proj\.weight. has shape \(96, 64\), the model expects \(100, 64\)",
    ):
        load_target_stage(Checkpoint(copy), range(2), True, True)
