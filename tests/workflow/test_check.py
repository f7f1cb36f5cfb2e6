"""`check`'s workflow (examine, repair, examine again): the fault matrix (every fault found by two independent
signals and repaired to a passing battery), healthy configurations, TP faults found and repaired on their rank, and
a user's battery."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from safetensors.torch import load_file, save_file

from specdoctor.runtime.checkpoint.files import DEMO_DIR, DEMO_MODELS
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.workflow.check import CheckOptions, run_check
from tests.commands.test_cli import rename_key
from tests.conftest import make_hf_checkpoint
from tests.helpers.fp8_checkpoint import write_fp8_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
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


def test_user_battery(tmp_path):
    battery = tmp_path / "battery.jsonl"
    battery.write_text('{"name": "a", "prompt": "def f(x):\\n    return"}\n\n{"prompt": "import re\\n"}\n')
    report = run_check(check_options("demo", 1, None, 2, battery=battery), show_progress=False)
    assert report.stages[0].behaviour["battery"] == "2/2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"name": "no prompt"}\n')
    with pytest.raises(Exception, match="bad.jsonl:1"):
        run_check(check_options("demo", 1, None, 2, battery=bad), show_progress=False)
