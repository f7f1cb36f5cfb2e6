"""Issue-level invariants of the runtime on the trained demo model: lossless speculative decoding at
every PP and k, acceptance independent of PP, and the broken loading policies' collapse."""

from __future__ import annotations

import pytest

from specdoctor.errors import PipelineError
from specdoctor.runtime.checkpoint.files import DEMO_MODELS
from specdoctor.runtime.checkpoint.tokenizer import TextCodec
from specdoctor.runtime.decode.batch import decode_batch
from specdoctor.runtime.decode.requests import GenerateRequest
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import load_rank
from tests.helpers.checkpoints import zeroed_enorm_copy

TEXTS = [
    "import os\nimport sys\n\ndef main(",
    "class Parser:\n    def __init__(self",
    "    for line in lines:\n        if not line",
    "def read_config(path):\n    with open(",
    "        raise ValueError(",
    "    return '%s(%r)' % (self.__class__",
]
NEW_TOKENS = 40
DEMO = "demo"  # the demo whose prompts and one-process results the module's fixtures give (conftest.py)


def demo_prompts(demo: str) -> list[list[int]]:
    codec = TextCodec(DEMO_MODELS[demo] / "tokenizer.json")
    return [codec.encode(text) for text in TEXTS]


def one_process(demo: str, prompts: list[list[int]]) -> dict:
    """PP = 1 in this process: plain greedy tokens (k = 0) and the speculative results for k = 1..5."""
    model, _ = load_rank(RuntimeOptions(demo), 0)
    results = {k: decode_batch(model, GenerateRequest(prompts, NEW_TOKENS, num_speculative_tokens=k)) for k in range(6)}
    model.comm.close()
    return results


def test_fixed_policy_single_process_is_lossless_with_real_acceptance(single_process):
    plain = single_process[0].tokens
    for k in range(1, 6):
        assert single_process[k].tokens == plain, k
        assert single_process[k].metrics.mean_acceptance_length > 1.5, k


@pytest.mark.parametrize("pp, partition", [(2, "1,3"), (3, None), (4, None)])
def test_pipeline_speculative_output_and_acceptance_equal_single_process(prompts, single_process, pp, partition):
    with Engine(RuntimeOptions("demo", pp=pp, pp_partition=partition, timeout=60)) as engine:
        for k in range(1, 6):
            result = engine.generate(prompts, NEW_TOKENS, num_speculative_tokens=k)
            assert result.tokens == single_process[0].tokens, (pp, k)
            assert result.metrics == single_process[k].metrics, (pp, k)


def legacy_run(prompts, fill: str, model: str = "demo", policy: str = "engine-legacy"):
    with Engine(RuntimeOptions(model, pp=2, num_speculative_tokens=3, drafter_policy=policy, fill=fill)) as engine:
        return engine.drafter_provenance["embed_tokens.weight"], engine.generate(prompts, NEW_TOKENS)


def test_an_uninitialised_drafter_embedding_stays_lossless_whatever_it_holds(prompts, single_process):
    """`empty` keeps whatever torch.empty gave (zeros, NaN, another buffer's bytes): only what holds for
    every content is asserted."""
    source, result = legacy_run(prompts, "empty")
    assert source == "unfilled:empty"
    assert result.tokens == single_process[0].tokens


def test_a_zero_filled_embedding_drafts_exactly_like_a_zeroed_enorm(prompts, single_process, tmp_path):
    """enorm(0) = 0 = enorm with zero weights applied to any embedding: the two drafters are the same function,
    so tokens, drafts and acceptance are identical, whatever the numbers are."""
    source, zero_filled = legacy_run(prompts, "zeros")
    copy = zeroed_enorm_copy(DEMO_MODELS["demo"], tmp_path / "zeroed", layer=4)
    _, zeroed_enorm = legacy_run(prompts, "empty", str(copy), policy="fixed")
    assert source == "unfilled:zeros"
    assert zero_filled.tokens == zeroed_enorm.tokens == single_process[0].tokens
    assert zero_filled.metrics == zeroed_enorm.metrics
    assert zero_filled.proposals == zeroed_enorm.proposals
    assert zero_filled.metrics.mean_acceptance_length < single_process[3].metrics.mean_acceptance_length


def test_a_nan_embedding_proposes_one_token_whatever_the_context(prompts, single_process):
    """NaN in, NaN logits out: argmax is the same index for every draft."""
    source, result = legacy_run(prompts, "nan")
    assert source == "unfilled:nan"
    assert result.tokens == single_process[0].tokens
    assert len(result.proposals) > 20 and len(set(result.proposals)) == 1


def test_an_aliased_placeholder_embedding_fails_the_first_draft_step_as_in_vllm(prompts):
    """The placeholder hands the drafter token ids where an embedding belongs; the engine dies on the
    first request with the error of the step that received them, named by the drafter's rank."""
    options = RuntimeOptions("demo", pp=2, num_speculative_tokens=3, drafter_policy="alias-placeholder")
    with Engine(options) as engine:
        assert engine.drafter_provenance["embed_tokens.weight"] == "placeholder:model.embed_tokens"
        assert engine.generate(prompts, 4, num_speculative_tokens=0).tokens  # the target alone is fine
        with pytest.raises(
            PipelineError, match=r"^rank 1: ValueError: MTP input: the embedding lookup gave torch.int64"
        ):
            engine.generate(prompts, NEW_TOKENS)
        assert not engine.alive


def test_stale_bytes_in_the_embedding_are_lossless_and_hurt_acceptance(prompts, single_process):
    with Engine(
        RuntimeOptions("demo", pp=2, num_speculative_tokens=3, drafter_policy="engine-legacy", fill="stale")
    ) as engine:
        result = engine.generate(prompts, NEW_TOKENS)
    assert result.tokens == single_process[0].tokens
    assert result.metrics.mean_acceptance_length < single_process[3].metrics.mean_acceptance_length


def test_an_unloaded_nan_head_proposes_one_token_whatever_the_context(prompts, single_process):
    with Engine(RuntimeOptions("demo", pp=2, num_speculative_tokens=3, head_policy="unloaded", fill="nan")) as engine:
        assert engine.drafter_provenance["layers.4.shared_head.head.weight"] == "unfilled:nan"
        result = engine.generate(prompts, NEW_TOKENS)
    assert result.tokens == single_process[0].tokens
    assert len(result.proposals) > 20 and len(set(result.proposals)) == 1


def test_fixed_policy_at_pp2_reaches_the_quality_bar(prompts):
    with Engine(RuntimeOptions("demo", pp=2, num_speculative_tokens=3, timeout=60)) as engine:
        assert engine.drafter_provenance["embed_tokens.weight"] == "checkpoint:model.embed_tokens.weight"
        result = engine.generate(prompts, NEW_TOKENS)
    assert result.metrics.mean_acceptance_length >= 2.0
