"""Verdicts on checkpoints we did not make: quantised weights refused by the runtime, no tokenizer, an MTP
layer's own copies of the embedding, and every drafter tensor compared with the checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdoctor.checks.drafter import drafter_findings
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from specdoctor.runtime.drafter.measure import measure_drafter
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.workflow.check import run_check
from tests.commands.test_check import specdoctor
from tests.conftest import make_hf_checkpoint
from tests.workflow.test_check import TOKENIZER_FILES, check_options, with_word_tokenizer

# DeepSeek-V3's own quantization_config (its config.json on the hub).
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def fp8_checkpoint(path, with_config: bool = True):
    """A transformers-made checkpoint whose linear weights are stored the way DeepSeek-V3's FP8 release
    stores them: float8_e4m3fn with a float32 `weight_scale_inv` per 128x128 block."""
    make_hf_checkpoint(path, seed=51)
    with_word_tokenizer(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(path / shard))
        for key in [k for k, v in tensors.items() if k.endswith("proj.weight") and v.dim() == 2]:
            weight = tensors[key].float()
            blocks = [-(-size // 128) for size in weight.shape]
            scale = weight.abs().amax().clamp(min=1e-12) / 448.0
            tensors[key] = (weight / scale).to(torch.float8_e4m3fn)
            tensors[key.removesuffix("weight") + "weight_scale_inv"] = torch.full(blocks, float(scale))
            index["weight_map"][key.removesuffix("weight") + "weight_scale_inv"] = shard
        save_file(tensors, str(path / shard), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    if with_config:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": FP8_CONFIG}))
    return path


def test_block_fp8_weights_run(tmp_path):
    path = fp8_checkpoint(tmp_path / "fp8")
    generate = specdoctor("generate", "--model", str(path), "--prompt", "w1 w2", "--max-tokens", "4")
    assert generate.returncode == 0, generate.stderr
    check = specdoctor("check", "--model", str(path), "--pp", "2", "--json", "-")
    assert [stage["name"] for stage in json.loads(check.stdout)["stages"]] == ["before"]


def test_float8_weights_without_a_scheme_are_refused_by_the_runtime_and_read_by_the_header_stages(tmp_path):
    path = fp8_checkpoint(tmp_path / "fp8", with_config=False)
    scheme = "quantised weights without a quantization_config (132 "
    generate = specdoctor("generate", "--model", str(path), "--prompt", "w1 w2", "--max-tokens", "4")
    assert generate.returncode == 2 and scheme in generate.stderr and "will not run them" in generate.stderr
    assert len(generate.stderr.strip().splitlines()) == 1 and "Traceback" not in generate.stderr
    inspect = specdoctor("inspect", "--model", str(path), "--json", "-")
    assert inspect.returncode == 0 and json.loads(inspect.stdout)["quantization"].startswith(scheme)
    check = specdoctor("check", "--model", str(path), "--pp", "2", "--json", "-")
    report = json.loads(check.stdout)
    # The pre-flight's error (weights no one can dequantise exactly) sets the exit code; the runtime is skipped.
    assert check.returncode == report["verdict"]["exit_code"] == 1 and report["stages"] == []
    assert {f["check"] for f in report["preflight"] if f["severity"] == "error"} == {
        "quantization.unreadable",
        "runtime.skipped",
    }
    assert report["verdict"]["summary"].startswith("not verified: checked pre-flight; not run: ")
    skipped = [f for f in report["preflight"] if f["check"] == "runtime.skipped"]
    assert skipped and scheme in skipped[0]["message"]


def untokenized_copy(tmp_path):
    path = tmp_path / "untokenized"
    shutil.copytree(DEMO_DIR, path, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    return path


def test_without_a_tokenizer_generate_needs_one_and_tokenizer_points_at_it(tmp_path):
    path = untokenized_copy(tmp_path)
    refused = specdoctor("generate", "--model", str(path), "--prompt", "def f(")
    assert refused.returncode == 2 and "point --tokenizer at one" in refused.stderr
    args = ("generate", "--prompt", "def f(", "--max-tokens", "8", "--json", "-")
    own = json.loads(specdoctor(*args, "--model", "demo").stdout)
    pointed = specdoctor(*args, "--model", str(path), "--tokenizer", str(DEMO_DIR / "tokenizer.json"))
    assert pointed.returncode == 0, pointed.stderr
    assert json.loads(pointed.stdout)["outputs"][0]["tokens"] == own["outputs"][0]["tokens"]


def test_a_battery_may_give_token_ids(tmp_path):
    battery = tmp_path / "ids.jsonl"
    battery.write_text('{"name": "ids", "token_ids": [476, 1843, 8]}\n{"prompt": "def main("}\n')
    report = run_check(check_options("demo", 1, None, 2, "fixed", battery=battery), show_progress=False)
    assert report.stages[0].behaviour["battery"] == "2/2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"token_ids": [1, -2]}\n')
    with pytest.raises(Exception, match='bad.jsonl:1: expected an object with a non-empty "prompt" string or'):
        run_check(check_options("demo", 1, None, 2, battery=bad), show_progress=False)
    text = untokenized_copy(tmp_path)
    with pytest.raises(Exception, match="is text, but there is no tokenizer"):
        run_check(check_options(str(text), 1, None, 2, battery=battery), show_progress=False)


OWN_EMBEDDING = "model.layers.4.embed_tokens.weight"


def with_own_embedding(tmp_path, name: str, change):
    """The demo plus an MTP-layer copy of the embedding, `change(target embedding)`, in its own shard."""
    path = tmp_path / name
    shutil.copytree(DEMO_DIR, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    target = load_file(str(path / index["weight_map"]["model.embed_tokens.weight"]))["model.embed_tokens.weight"]
    save_file({OWN_EMBEDDING: change(target).contiguous()}, str(path / "mtp-embedding.safetensors"))
    index["weight_map"][OWN_EMBEDDING] = "mtp-embedding.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.mark.parametrize(
    "name, change, severity, words",
    [
        ("identical", lambda t: t.clone(), "info", "is identical"),
        ("shifted", lambda t: t.roll(3, dims=0), "error", "shifted by -3"),
        (
            "permuted",
            lambda t: t[torch.randperm(t.shape[0], generator=torch.Generator().manual_seed(0))],
            "error",
            "permuted",
        ),
        ("different", lambda t: t + 0.5, "warning", "differs from (on 64 of 64"),
    ],
)
def test_an_mtp_layers_own_embedding_is_compared_with_the_targets(tmp_path, name, change, severity, words):
    from specdoctor.checks.own_copies import own_copy_findings
    from specdoctor.runtime.checkpoint.reader import Checkpoint

    findings = own_copy_findings(Checkpoint(with_own_embedding(tmp_path, name, change)))
    # The demo ships its MTP head too, identical to lm_head (it was trained shared).
    head = [f for f in findings if "shared_head.head" in f.message]
    assert [(f.severity, "is identical" in f.message) for f in head] == [("info", True)]
    embedding = [f for f in findings if OWN_EMBEDDING in f.message]
    assert [(f.check, f.severity) for f in embedding] == [("checkpoint.own_copy", severity)]
    assert words in embedding[0].message


def test_the_drafter_is_compared_with_its_own_copy_and_the_legacy_loader_reads_it(tmp_path):
    """With an own copy that differs from the target's, the correct source is the copy: the fixed loading
    reads it, the check compares with it, and engines that keep only spec-layer keys (legacy) load it too."""
    path = with_own_embedding(tmp_path, "trained-own", lambda t: t * 1.5)
    for policy in ("fixed", "engine-legacy"):
        report = run_check(check_options(str(path), 2, None, 3, policy, "fixed"), show_progress=False)
        drafter = report.stages[0].drafter
        assert drafter["provenance"]["embed_tokens.weight"] == f"checkpoint:{OWN_EMBEDDING}", policy
        assert drafter["tensors"]["embed_tokens.weight"]["checkpoint_key"] == OWN_EMBEDDING
        assert report.stages[0].signals()["content"] == [], policy


def test_every_drafter_tensor_is_compared_with_the_checkpoint():
    """Not only the embedding and head: a block weight of the MTP layer that holds something else is found."""
    model, _ = load_rank(RuntimeOptions("demo"), 0)
    try:
        weight = model.drafter.layers["4"].self_attn.o_proj.weight
        with torch.no_grad():
            weight.zero_()  # what an unloaded block weight holds after a zero-filling allocator
        findings, by_tp_rank = drafter_findings(measure_drafter(model), "before")
        broken = by_tp_rank[0]  # TP 1: rank 0 alone
    finally:
        model.comm.close()
    fingerprint = [f for f in findings if f.check == "drafter.fingerprint"]
    assert [f.data["name"] for f in fingerprint] == ["layers.4.self_attn.o_proj.weight"]
    assert broken == ["layers.4.self_attn.o_proj.weight"]


def test_a_shifted_own_copy_fails_the_check_although_the_drafter_matches_it(tmp_path):
    """A broken re-export: the drafter loads the copy faithfully (content matches it), so the check's
    verdict rests on comparing the copy with the target's table, and on the behaviour it causes."""
    path = with_own_embedding(tmp_path, "shifted", lambda t: t.roll(1, dims=0))
    report = run_check(check_options(str(path), 2, None, 3, "fixed", "fixed"), show_progress=False)
    assert any(f.check == "checkpoint.own_copy" and f.severity == "error" for f in report.preflight)
    assert report.stages[0].signals() == {"content": [], "behaviour": ["behaviour.acceptance"]}
    assert report.exit_code == 1
