"""The memory plan, and `check` on a model that does not fit: the pre-flight and the loaded-drafter stage on the
drafter's rank alone, the stages that could not run named, never healthy (exit 1, "not verified")."""

from __future__ import annotations

import json
import sys

import pytest

from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.registry import drafter_kind
from specdoctor.runtime.memory import plan_memory
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.partition import placements
from tests.commands.test_check import specdoctor
from tests.helpers.peak_memory import run_measured
from tests.helpers.real_size import DEEPSEEK_V3, write_sparse_checkpoint

FLOAT32_PER_STORED = {"BF16": 2, "F16": 2, "F32": 1}  # the compute dtype's bytes over the stored dtype's


def test_each_ranks_weights_are_its_checkpoint_tensors_in_the_compute_dtype():
    """Counted from the headers alone, the oracle: every tensor a rank of the demo at PP 2 reads, at 4 bytes a
    value. Rank 0 holds the embedding and layers 0-1; rank 1 layers 2-3, the norm, the head and the drafter
    (its MTP layer, and an embedding of its own, which engines allocate before they share or load it)."""
    checkpoint = Checkpoint("demo")
    config, tensors = checkpoint.config, checkpoint.tensors
    ranks = placements(config, 2, has_drafter=True)
    plan = plan_memory(checkpoint, ranks, drafter_kind(checkpoint, "demo", None), RuntimeOptions("demo", pp=2), 9, 64)

    def stored(keys) -> int:
        return sum(tensors[key].nbytes * FLOAT32_PER_STORED[tensors[key].dtype] for key in keys)

    layers = {rank.rank: [f"model.layers.{i}." for i in rank.layers] for rank in ranks}
    first = [key for key in tensors if key.startswith(tuple(layers[0]))] + ["model.embed_tokens.weight"]
    mtp = [key for key in tensors if key.startswith(f"model.layers.{config.num_hidden_layers}.")]
    last = [key for key in tensors if key.startswith(tuple(layers[1]))] + ["model.norm.weight", "lm_head.weight"]
    assert plan.ranks[0].weights == stored(first)
    assert plan.ranks[1].weights == stored(last + mtp + ["model.embed_tokens.weight"])
    assert plan.fits and plan.where == "host RAM" and not plan.limited


def test_a_limit_below_what_the_ranks_need_is_a_shortfall_named_in_one_line():
    checkpoint = Checkpoint("demo")
    ranks = placements(checkpoint.config, 4, has_drafter=True)
    options = RuntimeOptions("demo", pp=4, num_speculative_tokens=3)
    plan = plan_memory(checkpoint, ranks, drafter_kind(checkpoint, "demo", None), options, 9, 64, 200 << 20)
    assert not plan.fits and plan.limited and plan.available == [200 << 20]
    assert plan.shortfall() == f"the 4 rank(s) need {plan.needed / 1e9:.2f} GB of host RAM; the limit is 200 MiB"
    assert plan.needed == sum(rank.weights + rank.kv_cache + rank.workspace for rank in plan.ranks)


def test_a_check_that_cannot_hold_the_model_measures_the_drafter_alone_and_is_never_healthy():
    """demo at PP 4 as an unpatched engine loads it, in 200 MiB: the drafter's unloaded embedding is found by its
    content and repaired from the checkpoint, the battery did not run, and the verdict says so (exit 1)."""
    result = specdoctor("check", "--model", "demo", "--pp", "4", "--memory-limit", "200MiB", "--repair", "--json", "-")
    report = json.loads(result.stdout)
    assert result.returncode == report["verdict"]["exit_code"] == 1 and not report["verdict"]["healthy"]
    summary = report["verdict"]["summary"]
    assert summary.startswith("not verified: checked pre-flight, loaded drafter, repair; not run: the behaviour")
    assert "the limit is 200 MiB" in summary and report["memory"]["fits"] is False
    before, after = report["stages"]
    errors = {f["check"] for f in before["findings"] if f["severity"] == "error"}
    assert {"drafter.fingerprint", "drafter.provenance", "runtime.skipped"} <= errors
    assert report["repair"]["repaired"] == {"embed_tokens.weight": "model.embed_tokens.weight"}
    assert [f["check"] for f in after["findings"] if f["severity"] == "error"] == ["runtime.skipped"]
    assert before["behaviour"]["battery"] == after["behaviour"]["battery"] == "not run"
    assert report["comparison"][0]["mean_acceptance_length"] is None


def test_a_bad_memory_limit_is_one_line_and_exit_2():
    result = specdoctor("check", "--model", "demo", "--memory-limit", "lots")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        == "specdoctor: error: --memory-limit 'lots' is not a size such as 8GiB, 500MB or 1073741824"
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_size_deepseek_v3_is_checked_at_pp_8_within_8_gib(tmp_path):
    """DeepSeek-V3 at its real size (1.37 TB in bf16; sparse shards: only the drafter's tensors, the embedding and
    the head hold data), its MTP layer without its own embedding copy. `check --pp 8 --repair` on this 24 GB
    machine: the pre-flight, the drafter's content (its embedding unloaded, as an engine that skips sharing at
    PP > 1 leaves it), the repair reading that one tensor, and the stages it could not run, within 8 GiB for
    all its processes together. The time it takes is benchmarks/real_size.py's to measure."""
    write_sparse_checkpoint(tmp_path, DEEPSEEK_V3)
    command = [sys.executable, "-m", "specdoctor", "check", "--model", str(tmp_path), "--pp", "8", "--repair"]
    run = run_measured([*command, "--json", "-"], timeout_s=600)
    assert run.peak_bytes < 8 * 2**30, run.peak_bytes
    report = json.loads(run.stdout)
    assert run.returncode == report["verdict"]["exit_code"] == 1, run.stderr[-2000:]
    assert report["verdict"]["summary"].startswith("not verified: checked pre-flight, loaded drafter, repair")
    assert {f["check"] for f in report["preflight"]} >= {"placement.drafter_embedding", "config"}
    before, after = report["stages"]
    errors = {f["check"] for f in before["findings"] if f["severity"] == "error"}
    assert errors == {"drafter.provenance", "drafter.stats", "drafter.fingerprint", "runtime.skipped"}
    embedding = before["drafter"]["tensors"]["embed_tokens.weight"]
    assert embedding["zero_fraction"] == 1.0 and embedding["sampled_rows"] == 2048
    assert embedding["mismatched_rows"] == embedding["compared_rows"] == 64
    assert report["repair"]["bytes_read"] == 129280 * 7168 * 2  # the one tensor, nothing else
    assert [f["check"] for f in after["findings"] if f["severity"] == "error"] == ["runtime.skipped"]
    assert len(before["drafter"]["tensors"]) == len(after["drafter"]["tensors"]) > 700  # every MTP tensor measured
