"""`specdoctor check`: the fault matrix (every fault found by two independent signals and repaired to a
passing battery), healthy configurations, and the CLI contract (exit codes, JSON, JUnit)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdoctor.runtime.checkpoint.files import DEMO_DIR, DEMO_MODELS
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.tensor_parallel import TensorParallel
from specdoctor.workflow.check import CheckOptions, run_check
from tests.commands.test_cli import rename_key
from tests.conftest import make_hf_checkpoint
from tests.helpers.browser import images_loaded
from tests.helpers.fp8_checkpoint import write_fp8_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CUDA_DEVICES = torch.cuda.device_count()
CUDA_REFUSAL = "ranks on this machine need as many CUDA devices" if CUDA_DEVICES else "this machine has no CUDA device"
EMBED_KEY = "model.embed_tokens.weight"


def check_options(
    model, pp, partition=None, k=3, policy="engine-legacy", head="engine-legacy", fill="empty", tp=1, **rest
):
    runtime = RuntimeOptions(
        model,
        pp=pp,
        pp_partition=partition,
        tp=tp,
        num_speculative_tokens=k,
        drafter_policy=policy,
        head_policy=head,
        fill=fill,
    )
    return CheckOptions(runtime, **rest)


@pytest.fixture(scope="module")
def demo_variants(tmp_path_factory):
    """Copies of the demo: embedding only under model.language_model., no shared_head.head, one file; the
    MLA demo; and of each, a copy without a tokenizer (`NAME-untokenized`)."""
    root = tmp_path_factory.mktemp("demo_variants")
    language_model = root / "language_model"
    shutil.copytree(DEMO_DIR, language_model)
    rename_key(language_model, "model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    headless = root / "headless"
    shutil.copytree(DEMO_DIR, headless)
    rename_key(headless, "model.layers.4.shared_head.head.weight", None)
    single = root / "single_file"
    shutil.copytree(DEMO_DIR, single, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for shard in sorted(DEMO_DIR.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    save_file(tensors, str(single / "model.safetensors"), metadata={"format": "pt"})
    fp8 = root / "fp8"  # block-scaled FP8 by transformers' own quantiser (64 x 64: the demo's widths)
    write_fp8_checkpoint(DEMO_DIR, fp8, (64, 64))
    variants = {"language_model": language_model, "headless": headless, "single": single, "fp8": fp8, **DEMO_MODELS}
    for name, path in list(variants.items()):
        bare = root / f"{name}-untokenized"
        shutil.copytree(path, bare, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
        variants[f"{name}-untokenized"] = bare
    return {name: str(path) for name, path in variants.items()}


FAULTS = [
    # (model, pp, partition, k, embedding policy, head policy, fill)
    ("demo", 2, None, 3, "engine-legacy", "engine-legacy", "empty"),
    ("demo", 3, None, 1, "engine-legacy", "engine-legacy", "zeros"),
    ("demo", 4, None, 5, "engine-legacy", "engine-legacy", "nan"),
    ("demo", 2, "1,3", 3, "engine-legacy", "engine-legacy", "stale"),
    ("demo", 3, "1,1,2", 5, "alias-placeholder", "engine-legacy", "empty"),
    ("headless", 4, None, 1, "fixed", "engine-legacy", "nan"),
    ("language_model", 2, None, 3, "engine-legacy", "engine-legacy", "empty"),
    ("single", 2, None, 3, "engine-legacy", "engine-legacy", "zeros"),
    ("demo-mla", 4, None, 3, "engine-legacy", "engine-legacy", "nan"),
    ("demo-hybrid", 4, None, 3, "engine-legacy", "engine-legacy", "nan"),
    ("demo-w4a16", 4, None, 3, "engine-legacy", "engine-legacy", "nan"),
    ("fp8", 3, None, 3, "engine-legacy", "engine-legacy", "zeros"),
]


@pytest.mark.parametrize(
    "model, pp, partition, k, policy, head, fill",
    FAULTS,
    ids=[
        "legacy-empty",
        "legacy-zeros",
        "legacy-nan",
        "legacy-stale",
        "alias-placeholder",
        "unloaded-head",
        "language-model-prefix",
        "single-file-checkpoint",
        "mla-legacy-nan",
        "hybrid-legacy-nan",
        "w4a16-legacy-nan",
        "fp8-legacy-zeros",
    ],
)
def test_fault_is_found_by_content_and_behaviour_and_repaired_with_or_without_a_tokenizer(
    demo_variants, model, pp, partition, k, policy, head, fill
):
    """Each fault fires an error from the weights' content against the checkpoint and one from the
    drafter's behaviour (the runtime's own provenance label does not count), the repair makes both
    clean, and a copy without tokenizer.json (the token-id battery) reaches the same verdicts. What
    `empty` memory holds varies from run to run, so for it only the content signal is asserted."""
    verdicts = []
    for variant in (model, f"{model}-untokenized"):
        options = check_options(demo_variants[variant], pp, partition, k, policy, head, fill, repair=True)
        report = run_check(options, show_progress=False)
        before, after = report.stages
        signals = before.signals()
        assert signals["content"], before.findings
        assert signals["behaviour"] or fill == "empty" and policy == "engine-legacy", before.findings
        assert report.repair.repaired
        assert not [f for f in after.findings if f.severity == "error"], after.findings
        assert after.behaviour["battery"] == "9/9"
        assert report.healthy and report.exit_code == 0
        # A NaN embedding or head makes every draft token 0 whatever the context: the spread of the proposals
        # names that on its own. Zeroed or stale weights still vary with the context, and so do healthy ones.
        constant = [f for f in before.findings if f.check == "behaviour.constant_proposals"]
        if fill == "nan":
            assert [(f.severity, f.message.split(" (")[0]) for f in constant] == [
                ("error", f"100% of {before.behaviour['proposals']['count']} drafts are token 0")
            ]
            assert "behaviour.constant_proposals" in signals["behaviour"]
        elif fill != "empty":
            assert constant == [], constant
        assert not [f for f in after.findings if f.check == "behaviour.constant_proposals"], after.findings
        # Whether `empty` memory's statistics look abnormal varies with what it holds; the fingerprint against
        # the checkpoint fires for every value, so only that is compared for it.
        content = [c for c in signals["content"] if not (fill == "empty" and c == "drafter.stats")]
        verdicts.append((content, before.behaviour["battery"], [s.name for s in report.stages]))
        warnings = {f.check for f in report.preflight if f.severity == "warning"}
        assert ("behaviour.battery" in warnings) == variant.endswith("-untokenized")
    assert verdicts[0] == verdicts[1]


@pytest.mark.parametrize(
    "model, pp, policy",
    [
        ("demo", 1, "engine-legacy"),
        ("demo", 4, "fixed"),
        ("demo-mla", 4, "fixed"),
        ("demo-hybrid", 4, "fixed"),
        ("demo-w4a16", 4, "fixed"),
        ("demo-dspark", 1, "engine-legacy"),
        ("demo-dspark", 4, "fixed"),
    ],
    ids=[
        "pp1-legacy",
        "pp4-fixed",
        "mla-pp4-fixed",
        "hybrid-pp4-fixed",
        "w4a16-pp4-fixed",
        "dspark-pp1-legacy",
        "dspark-pp4-fixed",
    ],
)
def test_healthy_configurations_have_no_error_findings(model, pp, policy):
    k = None if model == "demo-dspark" else 3  # a DSpark drafter drafts its block size by default
    report = run_check(check_options(model, pp, None, k, policy, "engine-legacy"), show_progress=False)
    errors = [f for f in report.all_findings() if f.severity == "error"]
    assert not errors, errors
    assert report.stages[0].behaviour["battery"] == "9/9"
    assert report.exit_code == 0


def with_word_tokenizer(path, vocab: int = 320) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))


def test_tied_transformers_checkpoint_loads_its_drafter_from_the_tied_tensor(tmp_path):
    """A tied checkpoint saved by transformers has no lm_head.weight: at PP 2 the fixed loading reads the
    drafter's embedding from the tied tensor and its head from the MTP layer's own copy, so every drafter
    tensor matches the checkpoint; the legacy loading leaves the embedding NaN, which content finds, and
    the repair clears. The drafter is random here, so acceptance is not asserted: content and
    losslessness are."""
    make_hf_checkpoint(tmp_path, seed=31, tie_word_embeddings=True)
    with_word_tokenizer(tmp_path)
    healthy = run_check(check_options(str(tmp_path), 2, None, 3, "fixed", "engine-legacy"), show_progress=False)
    assert healthy.stages[0].signals()["content"] == []
    provenance, tensors = healthy.stages[0].drafter["provenance"], healthy.stages[0].drafter["tensors"]
    assert provenance["embed_tokens.weight"] == "checkpoint:model.embed_tokens.weight"
    assert provenance["layers.4.shared_head.head.weight"] == "checkpoint:model.layers.4.shared_head.head.weight"
    assert tensors["embed_tokens.weight"]["checkpoint_key"] == "model.embed_tokens.weight"
    assert healthy.stages[0].behaviour["battery"] == "9/9"
    legacy = run_check(
        check_options(str(tmp_path), 2, None, 3, "engine-legacy", "engine-legacy", "nan", repair=True),
        show_progress=False,
    )
    assert {"drafter.stats", "drafter.fingerprint"} <= set(legacy.stages[0].signals()["content"])
    assert legacy.stages[1].signals()["content"] == [] and legacy.stages[1].behaviour["battery"] == "9/9"


def test_missing_mtp_tensor_is_a_preflight_error(demo_variants, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(DEMO_DIR, path)
    rename_key(path, "model.layers.4.eh_proj.weight", None)
    report = run_check(check_options(str(path), 2, None, 1, "fixed", "engine-legacy"), show_progress=False)
    assert any(f.check == "mtp.tensors" and f.severity == "error" for f in report.preflight)
    assert any(f.check == "drafter.provenance" and f.severity == "error" for f in report.stages[0].findings)
    assert report.exit_code == 1


def specdoctor(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = os.environ | {"COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "specdoctor", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def test_cli_broken_drafter_exits_1_with_json_and_junit(tmp_path):
    junit = tmp_path / "report.xml"
    result = specdoctor("check", "--model", "demo", "--pp", "2", "--json", "-", "--junit-xml", str(junit))
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)  # --json - prints only JSON
    assert report["schema"] == "specdoctor.check/1"
    assert report["verdict"] == {"healthy": False, "exit_code": 1, "summary": report["verdict"]["summary"]}
    assert report["comparison"][0]["battery"] == "9/9"
    assert report["placement"][1]["has_drafter"] and not report["placement"][1]["has_embedding"]
    suite = ET.parse(junit).getroot()
    failed = {case.get("name") for case in suite.iter("testcase") if case.find("failure") is not None}
    assert {"drafter.provenance", "behaviour.acceptance"} <= failed
    assert int(suite.get("failures")) == len(failed)


def test_cli_repair_prints_before_after_and_exits_0(tmp_path):
    out, html = tmp_path / "report.json", tmp_path / "report.html"
    result = specdoctor("check", "--model", "demo", "--pp", "2", "--repair", "--json", str(out), "--html", str(html))
    assert result.returncode == 0, result.stderr
    assert "Before / after" in result.stdout and "healthy after repair" in result.stdout
    report = json.loads(out.read_text())
    assert [row["stage"] for row in report["comparison"]] == ["before", "after"]
    # Whatever the uninitialised memory held, it is not the checkpoint's embedding; after the repair it is.
    before, after = report["stages"]
    assert "drafter.fingerprint" in before["signals"]["content"]
    assert after["signals"] == {"content": [], "behaviour": []}
    assert after["drafter"]["tensors"]["embed_tokens.weight"]["mismatched_rows"] == 0
    # The HTML report opens in a real browser, its before/after chart loaded.
    assert images_loaded(html, tmp_path / "profile") == (1, 1) and "healthy after repair" in html.read_text()


def test_repair_never_writes_to_the_checkpoint(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(DEMO_DIR, path)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in path.iterdir()}
    result = specdoctor("repair", "--model", str(path), "--pp", "2", "--json", "-")
    assert result.returncode == 0, result.stderr
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in path.iterdir()} == before


def test_check_at_tp_2_pp_2_finds_both_shards_unloaded_and_the_repair_reads_each_ranks_rows():
    """The seed's failure at TP > 1 (vllm#46994, TP 4 x PP 2): the drafter's stage leaves its embedding unloaded
    on every TP rank. Four rank processes; each TP rank of the drafter's stage measures and repairs its own
    slice of the vocabulary (2,048 rows, a multiple of 64: 1,024 per rank, no padding)."""
    report = run_check(check_options("demo", 2, None, 3, tp=2, repair=True), show_progress=False)
    before, after = report.stages
    assert before.drafter["broken_by_tp_rank"] == {0: ["embed_tokens.weight"], 1: ["embed_tokens.weight"]}
    assert {f.data.get("tp_rank") for f in before.findings if f.check == "drafter.provenance"} == {0, 1}
    assert [f.severity for f in report.preflight if f.check == "placement.drafter_embedding"] == ["warning"]
    assert [row["ranks"] for row in report.placement] == [[0, 1], [2, 3]]
    shards = [result.tp_shard for result in report.repair.tp_ranks]
    assert [(s.tp_rank, s.rows, s.real_rows, s.padded_rows, s.ok) for s in shards] == [
        (0, [0, 1024], 1024, 0, True),
        (1, [1024, 2048], 1024, 0, True),
    ]
    # Each rank read its own 1,024 rows of the bf16 table (192 wide), and read them again to check them.
    assert report.repair.bytes_read == 2 * 2 * 1024 * 192 * 2
    assert before.behaviour["battery"] == after.behaviour["battery"] == "9/9"
    lengths = [stage.behaviour["metrics"]["mean_acceptance_length"] for stage in (before, after)]
    assert lengths[0] < 1.2 < 2.0 < lengths[1]
    assert report.exit_code == 0


@pytest.mark.parametrize("fault", ["per-rank-sharing", "vocab-shard-shifted"])
def test_a_tp_fault_of_one_rank_is_found_on_that_rank_and_repaired_there_alone(fault):
    """vllm#50158: each TP rank decides alone whether to share the embedding (rank 0 does, rank 1 leaves its slice
    as allocated); or the last rank reads its slice at the previous rank's range. Either way the findings name TP
    rank 1 alone, and only rank 1 reads its rows again."""
    options = check_options("demo", 2, None, 3, policy="fixed", tp=2, repair=True)
    options = dataclasses.replace(options, runtime=dataclasses.replace(options.runtime, fault=fault))
    report = run_check(options, show_progress=False)
    before, after = report.stages
    assert before.drafter["broken_by_tp_rank"] == {1: ["embed_tokens.weight"]}
    errors = [f for f in before.findings if f.severity == "error" and f.check.startswith("drafter.")]
    assert errors and all(f.data["tp_rank"] == 1 and f.message.startswith("TP rank 1/2: ") for f in errors)
    assert [result.repaired for result in report.repair.tp_ranks] == [{}, {"embed_tokens.weight": EMBED_KEY}]
    assert report.repair.bytes_read == 2 * 1024 * 192 * 2  # rank 1's rows, read and read again to check them
    assert after.drafter["broken"] == [] and after.behaviour["battery"] == "9/9"
    assert report.exit_code == 0


def test_tp_shard_check_compares_the_repaired_rows_with_the_checkpoint(tmp_path):
    """A vocabulary of 300 pads to 320 (vLLM's multiple of 64): at TP 4 the last rank holds 60 real rows
    and 20 zero rows. A repaired table whose rows are off by one fails; a TP size that does not split
    the padded vocabulary is refused, as vLLM's VocabParallelEmbedding refuses it."""
    from specdoctor.errors import SpecdoctorError
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.repair import check_vocab_shard
    from tests.conftest import make_hf_checkpoint

    make_hf_checkpoint(tmp_path, seed=41, vocab_size=300)
    checkpoint, key = Checkpoint(tmp_path), "model.embed_tokens.weight"
    table = checkpoint.read(key).float()
    last = torch.cat([table[240:], torch.zeros(20, table.shape[1])])  # TP 4 rank 3's slice, as loaded
    shard = check_vocab_shard(checkpoint, key, last, TensorParallel(3, 4))
    assert (shard.rows, shard.real_rows, shard.padded_rows) == ([240, 320], 60, 20)
    assert shard.ok
    assert not check_vocab_shard(checkpoint, key, last.roll(1, dims=0), TensorParallel(3, 4)).matches_table
    with pytest.raises(SpecdoctorError, match="does not split over 3 tensor-parallel ranks"):
        check_vocab_shard(checkpoint, key, table, TensorParallel(0, 3))


@pytest.mark.parametrize(
    "args, message",
    [
        (("--pp", "0"), "--pp must be at least 1"),
        (("--num-speculative-tokens", "0"), "must be in 1..8"),
        (("--drafter-policy", "bogus"), "Invalid value for '--drafter-policy'"),
        (("--battery", "/nonexistent/battery.jsonl"), "cannot read battery"),
        (("--tensor-parallel-size", "3", "--repair"), "--tensor-parallel-size 3: 2 KV heads neither divide over"),
        (("--tp", "4"), "Total number of attention heads (6) must be divisible by tensor parallel size (4)"),
        (("--tp", "2", "--model", "demo-w4a16"), "input values of 192 are not whole multiples of 64"),
        # NCCL runs one rank per GPU: one rank more than this machine's GPUs (on CI, --device cuda itself)
        (("--device", "cuda", "--pp", str(CUDA_DEVICES + 1)), CUDA_REFUSAL),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    result = specdoctor("check", "--model", "demo", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_user_battery(tmp_path):
    battery = tmp_path / "battery.jsonl"
    battery.write_text('{"name": "a", "prompt": "def f(x):\\n    return"}\n\n{"prompt": "import re\\n"}\n')
    report = run_check(check_options("demo", 1, None, 2, battery=battery), show_progress=False)
    assert report.stages[0].behaviour["battery"] == "2/2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "no prompt"}\n')
    with pytest.raises(Exception, match="bad.jsonl:1"):
        run_check(check_options("demo", 1, None, 2, battery=bad), show_progress=False)
