"""The draft-model kind in the pipeline runtime, on models transformers saved: lossless at PP 1-4 for drafts of
the target's family and of another; the drafts are the draft model's own greedy continuation (transformers'
`generate` as the oracle); the engines' position-range failure found by behaviour and reported as not
repairable, its unloaded head found by content and repaired; the pre-flight's reading of the pair; and pairs
that do not fit refused in one line before any rank starts. vLLM's tokens and counters for a draft model are
the peer suite's (tests/peer/test_vllm_oracle.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests.helpers.drafter_runs import (
    NEW_TOKENS,
    drafter_options,
    plain_tokens_of,
    preflight_by_check,
    repaired_check,
    speculative_run,
)
from tests.helpers.families import PIPELINE_PROMPTS
from tests.runtime.drafter.draft_model.conftest import SHORT_RANGE


@pytest.fixture(scope="module")
def plain_tokens(dm_target):
    return plain_tokens_of(dm_target)


@pytest.mark.parametrize(
    "draft_fixture, pp, k",
    [("first_layers", 1, 3), ("first_layers", 4, 5), ("llama_draft", 2, 2), ("short_range", 3, 4)],
)
def test_speculative_decoding_is_lossless_at_every_pp(request, dm_target, plain_tokens, draft_fixture, pp, k):
    result = speculative_run(dm_target, request.getfixturevalue(draft_fixture), pp, k)
    assert result.tokens == plain_tokens
    if draft_fixture == "short_range":  # the target drafting for itself: every draft passes
        assert result.metrics.num_accepted_tokens == result.metrics.num_draft_tokens


@pytest.mark.parametrize("pp", [1, 2])
def test_the_first_drafts_are_the_draft_models_own_greedy_continuation(dm_target, first_layers, pp):
    """After the prompt pass, the k drafts equal transformers' greedy continuation of the draft model over the
    prompt and the target's first token: its cache holds every prompt position, the first one included."""
    import torch
    import transformers

    from specdoctor.runtime.engine import Engine

    k = 4
    draft = transformers.AutoModelForCausalLM.from_pretrained(first_layers, dtype=torch.float32).eval()
    with Engine(drafter_options(dm_target, first_layers, pp=pp)) as engine:
        for prompt in PIPELINE_PROMPTS:
            result = engine.generate([prompt], 2, num_speculative_tokens=k)
            context = torch.tensor([prompt + result.tokens[0][:1]])
            expected = draft.generate(context, max_new_tokens=k, do_sample=False, min_new_tokens=k)[0, -k:].tolist()
            assert result.proposals[:k] == expected, prompt


def check(target, draft, **fields):
    return repaired_check(target, draft, 16, **fields)


def errors(findings) -> set[str]:
    return {f.check for f in findings if f.severity == "error"}


@pytest.mark.parametrize("pp", [1, 4])
def test_dummy_drafts_past_the_position_range_are_found_and_reported_not_repairable(dm_target, short_range, pp):
    report = check(dm_target, short_range, pp=pp, draft_range_policy="dummy")
    before = report.stages[0]
    assert before.behaviour["battery"] == "9/9"  # output stays right: the failure is silent
    assert "draft_model.dummy_drafts" in errors(before.findings), before.findings
    assert report.repair.repaired == {} and len(report.stages) == 1 and report.exit_code == 1
    assert f"position range {SHORT_RANGE}" in report.verdict()
    warning = next(f for f in report.preflight if f.check == "draft_model.position_range")
    assert warning.severity == "warning" and f"passes {SHORT_RANGE} tokens" in warning.message


def test_past_its_range_a_fixed_engine_keeps_drafting(dm_target, short_range):
    from specdoctor.runtime.engine import Engine

    report = check(dm_target, short_range, pp=2)
    assert report.exit_code == 0, report.verdict()
    assert report.stages[0].behaviour["metrics"]["acceptance_rate"] == 1.0
    long_prompt = [5 + i % 300 for i in range(4 * SHORT_RANGE)]  # far past the draft's own rotary range
    assert speculative_run(dm_target, short_range, 2, 3).metrics.acceptance_rate == 1.0
    with Engine(drafter_options(dm_target, short_range, pp=2)) as engine:
        plain = engine.generate([long_prompt], NEW_TOKENS).tokens
        drafted = engine.generate([long_prompt], NEW_TOKENS, num_speculative_tokens=3)
    assert drafted.tokens == plain and drafted.metrics.acceptance_rate == 1.0


def test_a_draft_model_runs_beside_a_target_with_mtp_layers():
    """vLLM leaves the target's MTP layers unused then: the demo drafting for itself accepts every draft."""
    from specdoctor.runtime.checkpoint.files import DEMO_DIR

    result = speculative_run("demo", DEMO_DIR, 2, 3)
    assert result.metrics.num_accepted_tokens == result.metrics.num_draft_tokens


@pytest.mark.parametrize("pp", [1, 4])
def test_an_unloaded_head_is_found_by_content_and_repaired(dm_target, first_layers, pp):
    report = check(dm_target, first_layers, pp=pp, head_policy="unloaded", fill="nan")
    assert "drafter.fingerprint" in errors(report.stages[0].findings), report.stages[0].findings
    assert list(report.repair.repaired) == ["lm_head.weight"]
    after = report.stages[1]
    assert not {c for c in errors(after.findings) if c.startswith("drafter.")} and after.behaviour["battery"] == "9/9"


def test_preflight_reads_the_pair(dm_target, llama_draft, first_layers):
    found = preflight_by_check(dm_target, llama_draft, 2)
    assert "LlamaForCausalLM, 1 layer(s)" in found["draft_model.config"][0].message
    assert found["draft_model.tensors"][0].severity == "info"
    # transformers' own defaults: LlamaConfig ends sequences at id 2, Qwen3Config names no end id
    warning = found["draft_model.special_ids"][0]
    assert warning.severity == "warning" and "ids [2] are not the target's []" in warning.message
    assert "draft_model.position_range" not in found
    same_family = preflight_by_check(dm_target, first_layers, 2)
    assert not {"draft_model.pairing", "draft_model.special_ids"} & set(same_family)


def rewritten(source, out, config: dict):
    """A copy of a draft checkpoint with config fields changed."""
    shutil.copytree(source, out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, **config}))
    return out


def with_tokenizer(source, out, vocab_shift: int, special: str = "<end>"):
    """A copy of a checkpoint with a tokenizer.json of its vocabulary, written by the tokenizers library: token
    `t{i + vocab_shift}` at id i, the last id an added special token."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    shutil.copytree(source, out)
    size = json.loads((out / "config.json").read_text())["vocab_size"] - 1
    tokenizer = Tokenizer(WordLevel({f"t{(i + vocab_shift) % size}": i for i in range(size)}, unk_token="t0"))
    tokenizer.add_special_tokens([special])
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def refusal(target, draft, **fields) -> str:
    from specdoctor.errors import SpecdoctorError
    from specdoctor.runtime.engine import Engine

    with pytest.raises(SpecdoctorError) as refused:
        Engine(drafter_options(target, draft, **fields))
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_pairs_that_do_not_fit_are_refused_before_any_rank_starts(dm_target, llama_draft, tmp_path):
    vocabulary = rewritten(llama_draft, tmp_path / "vocab", {"vocab_size": 384})
    assert "its vocabulary of 384 is not the target's 320" in refusal(dm_target, vocabulary)
    target = with_tokenizer(dm_target, tmp_path / "target", 0)
    other = with_tokenizer(llama_draft, tmp_path / "other-tokenizer", 1)
    assert "its tokenizer has 't1' at id 0 where the target's has 't0'" in refusal(target, other)
    same = with_tokenizer(llama_draft, tmp_path / "same-tokenizer", 0)
    assert "draft_model.pairing" not in preflight_by_check(target, same, 2)
    other_special = with_tokenizer(llama_draft, tmp_path / "other-special", 0, special="<pad>")
    # vLLM gives the draft the target's tokenizer: added tokens that differ warn, they do not refuse
    found = preflight_by_check(target, other_special, 2)
    assert "draft_model.pairing" not in found
    assert any(
        "'<pad>' at id 319 where the target's has '<end>'" in f.message for f in found["draft_model.special_ids"]
    )
    assert "not method 'dspark'" in refusal(dm_target, llama_draft, speculative_method="dspark")


def test_a_hybrid_draft_model_is_refused(dm_target, tmp_path):
    from tests.helpers.families import make_family_checkpoint

    hybrid = tmp_path / "hybrid"
    make_family_checkpoint(hybrid, "Qwen3_5ForCausalLM")
    assert "linear-attention layers keep a recurrent state" in refusal(dm_target, hybrid)


def test_the_command_line_refuses_a_method_the_checkpoint_is_not(dm_target, llama_draft):
    config = json.dumps({"method": "dspark", "model": str(llama_draft), "num_speculative_tokens": 2})
    command = [sys.executable, "-m", "specdoctor", "check", "--model", str(dm_target), "--speculative-config", config]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "the drafter is the draft model (method 'draft_model'), not method 'dspark'" in lines[0]


def test_inspect_describes_the_draft_model_and_its_range(dm_target, short_range):
    command = [sys.executable, "-m", "specdoctor", "inspect", "--model", str(dm_target)]
    command += ["--speculative-model", str(short_range), "--pp", "2", "--json", "-"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    drafter = summary["drafter_checkpoint"]
    assert drafter["label"] == "draft model" and drafter["draft_max_len"] == SHORT_RANGE
    assert "draft_model.position_range" in {finding["check"] for finding in summary["preflight"]}


def test_the_memory_plan_holds_the_draft_models_own_cache(dm_target, first_layers):
    """The drafter's rank holds keys and values for its target layers and for every draft layer: 2 × layers ×
    batch × length × KV heads × head size × 4 bytes (fp32), from the two configs."""
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import drafter_kind
    from specdoctor.runtime.memory import plan_memory
    from specdoctor.runtime.partition import placements

    checkpoint = Checkpoint(dm_target)
    kind = drafter_kind(checkpoint, str(dm_target), str(first_layers))
    ranks = placements(checkpoint.config, 2, None, has_drafter=True)
    batch, length = 9, 64
    plan = plan_memory(checkpoint, ranks, kind, drafter_options(dm_target, first_layers, pp=2), batch, length)

    def kv(config, layers: int) -> int:
        return 2 * layers * batch * length * config.num_key_value_heads * config.head_dim * 4

    target_layers = len(ranks[-1].layers)
    assert plan.ranks[-1].kv_cache == kv(checkpoint.config, target_layers) + kv(kind.drafter.config, 2)
    assert plan.ranks[0].kv_cache == kv(checkpoint.config, len(ranks[0].layers))
