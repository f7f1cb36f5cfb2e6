"""The DSpark demo (`demo-dspark`: a dense Qwen3 target and its DSpark drafter, block 5): shipped within its
size limit, read by transformers as it ships, lossless at every PP size and block size with acceptance
independent of PP, and the quality bar at PP 4."""

from __future__ import annotations

import pytest
import torch

from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS, DEMO_MODELS
from specdoctor.runtime.checkpoint.loader import load_full_target
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import TextCodec
from specdoctor.runtime.drafter.registry import drafter_checkpoint
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from tests.demos.test_demo_runtime import NEW_TOKENS, TEXTS

DEMO = "demo-dspark"
SIZE_LIMIT = 15_000_000  # target and drafter together (the bar)


def test_ships_as_a_target_and_a_drafter_checkpoint_within_the_size_limit():
    target, drafter = Checkpoint(DEMO), drafter_checkpoint(DEMO_DRAFTERS[DEMO])
    size = sum(p.stat().st_size for folder in (target.path, drafter.path) for p in folder.iterdir())
    assert 1_000_000 < size <= SIZE_LIMIT
    assert target.config.architecture == "Qwen3ForCausalLM" and target.config.num_nextn_predict_layers == 0
    assert drafter.config.architecture == "Qwen3DSparkModel" and drafter.config.block_size == 5
    # As DSpark drafters ship: no embedding or head of its own (the target's are shared), bf16 shards.
    assert not {"embed_tokens.weight", "lm_head.weight"} & drafter.tensors.keys()
    assert {t.dtype for t in drafter.tensors.values()} == {t.dtype for t in target.tensors.values()} == {"BF16"}
    assert target.layout == "index" and len({t.shard for t in target.tensors.values()}) >= 2


def test_transformers_reads_the_target_as_it_ships(prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO_MODELS[DEMO], dtype=torch.float32).eval()
    stage = load_full_target(Checkpoint(DEMO))
    ids = torch.tensor(prompts[0])[None]
    with torch.no_grad():
        expected = model(ids).logits
        ours = stage.logits(stage(ids, torch.arange(ids.shape[1])[None]))
    assert float((ours - expected).abs().max() / expected.abs().max()) < 1e-4


def test_every_block_size_is_lossless_with_real_acceptance(single_process):
    plain = single_process[0].tokens
    for k in range(1, 6):
        assert single_process[k].tokens == plain, k
        assert single_process[k].metrics.mean_acceptance_length > 1.5, k


@pytest.mark.parametrize("pp, partition", [(2, None), (3, None), (4, None)])
def test_pipeline_output_and_acceptance_equal_one_process(prompts, single_process, pp, partition):
    with Engine(RuntimeOptions(DEMO, pp=pp, pp_partition=partition, timeout=60)) as engine:
        for k in range(1, 6):
            result = engine.generate(prompts, NEW_TOKENS, num_speculative_tokens=k)
            assert result.tokens == single_process[0].tokens, (pp, k)
            assert result.metrics == single_process[k].metrics, (pp, k)


def test_inspect_describes_the_drafter_and_where_its_taps_live():
    from tests.commands.test_cli import specdoctor

    result = specdoctor("inspect", "--model", DEMO, "--pp", "4", "--json", "-")
    assert result.returncode == 0, result.stderr
    import json

    summary = json.loads(result.stdout)
    assert summary["drafter_checkpoint"]["architecture"] == "Qwen3DSparkModel"
    taps = next(f for f in summary["preflight"] if f["check"] == "placement.taps")
    assert taps["severity"] == "warning" and taps["data"]["owners"] == {"1": 1, "3": 2, "5": 3}
    assert any(f["check"] == "placement.drafter_embedding" for f in summary["preflight"])


def test_generate_and_bench_run_it_across_ranks_from_the_command_line(prompts, single_process, tmp_path):
    """vLLM's spelling of a DSpark drafter (`--speculative-config` with method and model), at PP 4; bench at
    PP 3 with its block size, lossless."""
    import json

    from tests.commands.test_cli import specdoctor

    config = json.dumps({"method": "dspark", "model": str(DEMO_DRAFTERS[DEMO]), "num_speculative_tokens": 5})
    args = [
        "--model",
        DEMO,
        "--pp",
        "4",
        "--speculative-config",
        config,
        "--max-tokens",
        str(NEW_TOKENS),
        "--json",
        "-",
    ]
    result = specdoctor("generate", *args, "--prompt", TEXTS[0])
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["outputs"][0]["tokens"] == single_process[0].tokens[0]
    assert report["metrics"]["mean_acceptance_length"] > 1.5
    battery = tmp_path / "battery.jsonl"
    battery.write_text(json.dumps({"prompt": TEXTS[1]}) + "\n")
    out = tmp_path / "bench.json"
    result = specdoctor("bench", "--model", DEMO, "--pp", "3", "--num-speculative-tokens", "5", "--max-tokens", "16",
                        "--battery", str(battery), "--json", str(out), "--no-compile")  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(row["pp"], row["k"]) for row in rows] == [(3, 0), (3, 5)] and all(row["lossless"] for row in rows)
    assert rows[1]["mean_acceptance_length"] > 1.5 and rows[1]["last_rank_ms_per_step"]["draft"] > 0


def test_serve_drafts_with_it_by_default_and_counts_like_vllm(prompts, single_process):
    """`serve --model demo-dspark --pp 2`: k is the drafter's block size (vLLM's default), the openai client
    gets plain greedy text, and /metrics counts the drafts."""
    from openai import OpenAI

    from tests.helpers.servers import SpecdoctorServer
    from tests.server.test_server import scrape

    server = SpecdoctorServer("--pp", "2", model=DEMO)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        completion = client.completions.create(model=DEMO, prompt=TEXTS[0], max_tokens=NEW_TOKENS, temperature=0)
        codec = TextCodec(DEMO_MODELS[DEMO] / "tokenizer.json")
        assert completion.choices[0].text == codec.decode(single_process[0].tokens[0])
        samples, label = scrape(server.url), f'{{model_name="{DEMO}"}}'
        drafts, tokens, accepted = (
            samples[f"vllm:spec_decode_num_{name}_total{label}"]
            for name in ("drafts", "draft_tokens", "accepted_tokens")
        )
        assert drafts > 0 and tokens == 5 * drafts and accepted > drafts / 2
    finally:
        server.stop()


# (PP, loading, the content signal that names it, the block shape behaviour sees, whether a checkpoint read
# repairs it). A tap fault's shape is not asserted: off by one the block looks healthy (66 45 25 19 9 %
# against 67 50 28 16 9 %), and only the tap probe tells (numbers: specdoctor/checks/acceptance.py).
FAULTS = {
    "embedding-unshared": (
        4,
        dict(drafter_policy="engine-legacy", fill="nan"),
        "drafter.fingerprint",
        "collapsed",
        True,
    ),
    "embedding-zeroed": (4, dict(drafter_policy="engine-legacy", fill="zeros"), "drafter.fingerprint", "decays", True),
    "head-unloaded": (2, dict(head_policy="unloaded", fill="zeros"), "drafter.stats", "collapsed", True),
    "markov-unloaded": (3, dict(markov_policy="unloaded", fill="zeros"), "drafter.fingerprint", "collapsed", True),
    "tap-not-relayed": (4, dict(tap_policy="local-only"), "drafter.taps", None, False),
    "tap-off-by-one": (3, dict(tap_policy="off-by-one"), "drafter.taps", None, False),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_check_names_each_fault_from_content_and_behaviour(fault):
    """Every DSpark fault keeps the output correct and fires a content signal that names it; the weight
    faults also show in the block's shape (a collapse at every position or a decay along it) and are
    repaired to a healthy 9/9 battery, while a tap fault, which no checkpoint read fixes, stays an error
    after --repair."""
    from specdoctor.workflow.check import CheckOptions, run_check

    pp, loading, content, shape, repairable = FAULTS[fault]
    runtime = RuntimeOptions(DEMO, pp=pp, num_speculative_tokens=None, **{"drafter_policy": "fixed", **loading})
    report = run_check(CheckOptions(runtime, repair=True), show_progress=False)
    before = report.stages[0]
    assert before.behaviour["battery"] == "9/9"
    assert content in before.signals()["content"], before.findings
    if shape:
        block = next(f for f in before.findings if f.check == "behaviour.block")
        # A collapse is an error; a decay a warning (a weak healthy drafter decays too).
        assert (block.severity, shape in block.message) == ("error" if shape == "collapsed" else "warning", True)
    if repairable:
        after = report.stages[1]
        assert not [f for f in after.findings if f.severity == "error"], after.findings
        assert after.behaviour["battery"] == "9/9" and report.exit_code == 0
    else:
        assert report.repair.repaired == {} and len(report.stages) == 1 and report.exit_code == 1
        assert report.verdict().split(": ", 1)[1].startswith("the tap of target layer")
