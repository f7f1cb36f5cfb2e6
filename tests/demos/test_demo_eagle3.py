"""The EAGLE-3 demo (`demo-eagle3`: demo-dspark's Qwen3 target with a trained EAGLE-3 head that speculators
saved, sharing the target's embedding and head): shipped within its size limit, lossless at every PP size and
k with acceptance independent of PP, its quality, and each engine failure found and repaired or reported
at PP 4."""

from __future__ import annotations

import json

import pytest

from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS, DEMO_MODELS
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.registry import drafter_checkpoint
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from tests.commands.test_cli import specdoctor
from tests.demos.test_demo_runtime import NEW_TOKENS, TEXTS

DEMO = "demo-eagle3"
SIZE_LIMIT = 12_000_000  # the head's own files (the bar); the target is demo-dspark's
# Mean acceptance length at k 5 on these six short prompts (2.96 measured): a floor against regressions. The
# issue's bar (>= 3.0 on held-out text, PP 4) is benchmarks/acceptance.py's figure (docs/demos.md).
QUALITY_FLOOR = 2.8


def test_ships_as_a_speculators_head_within_the_size_limit():
    head = drafter_checkpoint(DEMO_DRAFTERS[DEMO])
    assert sum(p.stat().st_size for p in head.path.iterdir()) <= SIZE_LIMIT
    config = head.config
    assert config.layout == "speculators" and config.aux_layer_ids == (1, 3, 5) and config.speculative_tokens == 5
    assert not {"embed_tokens.weight", "lm_head.weight"} & head.tensors.keys()  # the target's are shared
    assert Checkpoint(DEMO).path == DEMO_MODELS["demo-dspark"]


def test_every_k_is_lossless_and_the_quality_bar_holds(single_process):
    plain = single_process[0].tokens
    for k in range(1, 6):
        assert single_process[k].tokens == plain, k
    assert single_process[5].metrics.mean_acceptance_length >= QUALITY_FLOOR


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_output_and_acceptance_equal_one_process(prompts, single_process, pp):
    with Engine(RuntimeOptions(DEMO, pp=pp, timeout=60)) as engine:
        for k in (1, 3, 5):
            result = engine.generate(prompts, NEW_TOKENS, num_speculative_tokens=k)
            assert result.tokens == single_process[0].tokens, (pp, k)
            assert result.metrics == single_process[k].metrics, (pp, k)


# (loading on top of check's unpatched-engine defaults, the content signal that names it, whether a checkpoint
# read repairs it)
FAULTS = {
    "embedding-unshared": (dict(), "drafter.fingerprint", True),  # what vLLM 0.32 does at PP > 1
    "aux-not-relayed": (dict(drafter_policy="fixed", tap_policy="local-only"), "drafter.taps", False),
    "aux-off-by-one": (dict(drafter_policy="fixed", tap_policy="off-by-one"), "drafter.taps", False),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_check_at_pp4_names_each_fault_and_repairs_what_a_read_fixes(fault):
    loading, signal, repairable = FAULTS[fault]
    args = [f"--{name.replace('_', '-')}={value}" for name, value in loading.items()]
    result = specdoctor("check", "--model", DEMO, "--pp", "4", "--repair", *args, "--json", "-")
    report = json.loads(result.stdout)
    before = report["stages"][0]
    assert before["behaviour"]["battery"] == "9/9"
    assert signal in {f["check"] for f in before["findings"] if f["severity"] == "error"}
    if repairable:
        assert result.returncode == 0, report["verdict"]["summary"]
        assert "embed_tokens.weight" in report["repair"]["repaired"]
        assert report["stages"][1]["behaviour"]["battery"] == "9/9"
    else:  # wiring: exit 1 after --repair, and the verdict names the tap
        assert result.returncode == 1 and report["repair"]["repaired"] == {}
        assert "the tap of target layer" in report["verdict"]["summary"]


def test_inspect_describes_the_head_and_where_its_aux_states_live():
    result = specdoctor("inspect", "--model", DEMO, "--pp", "4", "--json", "-")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["drafter_checkpoint"]["architecture"] == "Eagle3LlamaForCausalLM"
    assert summary["drafter_checkpoint"]["aux_entries_read"] == [1, 3, 5]
    taps = next(f for f in summary["preflight"] if f["check"] == "placement.taps")
    assert taps["severity"] == "warning" and taps["data"]["owners"] == {"0": 0, "2": 1, "4": 2}
    assert any(f["check"] == "placement.drafter_embedding" for f in summary["preflight"])


def test_generate_runs_it_as_vllm_spells_it(single_process):
    config = json.dumps({"method": "eagle3", "model": str(DEMO_DRAFTERS[DEMO]), "num_speculative_tokens": 5})
    result = specdoctor("generate", "--model", "demo-dspark", "--pp", "4", "--speculative-config", config,
                        "--max-tokens", str(NEW_TOKENS), "--prompt", TEXTS[0], "--json", "-")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["outputs"][0]["tokens"] == single_process[0].tokens[0]
    assert report["metrics"]["mean_acceptance_length"] > 2.0
