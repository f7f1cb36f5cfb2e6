"""Tensor parallelism (runtime/tensor_parallel.py, sharding.py, models/parallel_layers.py): TP 2 x PP 2 is four
rank processes over gloo, each holding its slice of every sharded tensor. Oracles: transformers' own model classes
(the prompt logits and greedy tokens of each family, saved by them with a vocabulary of 300 rows, which vLLM pads to
320: the last TP rank holds 20 padding rows), and the runtime at TP 1 x PP 1 for the speculative counters of every
prompt.

Tolerance: float32 throughout; an all-reduce sums the ranks' partial projections in another order than one
matmul does. The single-process comparison allows 1e-4 relative and 1e-5 absolute; here 5e-5 absolute, what
Gated DeltaNet's recurrent state, fed by the reordered sums, was seen to need (2.1e-5 on 2 of 2,400 logits).
Greedy tokens, speculative counters and every draft token proposed must be equal.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.registry import drafter_kind
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.memory import plan_memory
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.partition import placements
from specdoctor.runtime.rank_loading import build_rank
from specdoctor.runtime.sampling import SamplingParams
from specdoctor.runtime.sharding import shard_range, vocab_shard_range
from specdoctor.runtime.tensor_parallel import TensorParallel
from specdoctor.workflow.check import CheckOptions, run_check
from tests.conftest import make_hf_checkpoint
from tests.helpers.draft_models import save_cut_down, save_target
from tests.helpers.families import PIPELINE_PROMPTS, make_family_checkpoint, plain_greedy, save_dense_checkpoint
from tests.runtime.test_packed_weights import held_bytes

PADDED_VOCAB = dict(vocab_size=300)  # pads to 320: TP 2 rank 1 holds rows [160, 320), 140 of them real

MAKERS = {
    "Glm4MoeForCausalLM": lambda path: make_hf_checkpoint(path, seed=3, **PADDED_VOCAB),
    "DeepseekV3ForCausalLM": lambda path: make_family_checkpoint(path, "DeepseekV3ForCausalLM", **PADDED_VOCAB),
    "GlmMoeDsaForCausalLM": lambda path: make_family_checkpoint(path, "GlmMoeDsaForCausalLM", **PADDED_VOCAB),
    # Gated DeltaNet: grouped in_proj_qkvz (Qwen3-Next), and q | k | v channels split segment by segment (Qwen3.5).
    "Qwen3NextForCausalLM": lambda path: make_family_checkpoint(path, "Qwen3NextForCausalLM", **PADDED_VOCAB),
    "Qwen3_5MoeForCausalLM": lambda path: make_family_checkpoint(path, "Qwen3_5MoeForCausalLM", **PADDED_VOCAB),
    # Llama's attention_bias biases o_proj too: a row-parallel bias, added once.
    "LlamaForCausalLM": lambda path: save_dense_checkpoint(
        path, "LlamaForCausalLM", attention_bias=True, **PADDED_VOCAB
    ),
    "Qwen3ForCausalLM": lambda path: save_dense_checkpoint(path, "Qwen3ForCausalLM", **PADDED_VOCAB),
}


@pytest.fixture(scope="module", params=sorted(MAKERS))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, MAKERS[request.param](path)


def speculative_runs(options: RuntimeOptions, ks) -> list:
    with Engine(options) as engine:
        return [engine.generate(PIPELINE_PROMPTS, 12, num_speculative_tokens=k) for k in ks]


@pytest.mark.slow
def test_tp_2_pp_2_matches_transformers_and_tp_1_for_every_family(family):
    path, model = family
    expected_tokens, expected_logits = plain_greedy(path, model)
    options = RuntimeOptions(str(path), pp=2, tp=2, timeout=60)
    with Engine(options) as engine:
        assert len(engine.rank_pids) == 4
        logits = engine.prompt_logits(PIPELINE_PROMPTS)
        assert logits.shape[-1] == 300  # the padding's logits are cut
        for row, prompt in enumerate(PIPELINE_PROMPTS):
            n = len(prompt)
            torch.testing.assert_close(logits[row, :n], expected_logits[row, :n], rtol=1e-4, atol=5e-5)
        assert engine.generate(PIPELINE_PROMPTS, 12).tokens == expected_tokens
        ks = (1, 3) if engine.speculates else ()
        sharded = [engine.generate(PIPELINE_PROMPTS, 12, num_speculative_tokens=k) for k in ks]
    whole = speculative_runs(RuntimeOptions(str(path), pp=1, tp=1, timeout=60), ks)
    for k, tp2, tp1 in zip(ks, sharded, whole, strict=True):
        assert tp2.tokens == tp1.tokens == expected_tokens, k
        assert tp2.row_metrics == tp1.row_metrics and tp2.metrics.num_drafts > 0, k
        assert tp2.proposals == tp1.proposals, k  # every draft token, accepted or not


DEMOS = {
    "demo": {},
    "demo-mla": {},
    "demo-w4a16": {"quantized_weights": "dequantized"},
    "demo-eagle3": {},
    "demo-dspark": {"num_speculative_tokens": 4},  # its block size
    "demo-hybrid": {},
}


@pytest.mark.slow
@pytest.mark.parametrize("demo", sorted(DEMOS))
def test_demos_at_tp_2_pp_2_give_tp_1_pp_1s_tokens_and_acceptance_counts(demo):
    prompts = [[5, 9, 14, 3, 77, 41, 8, 19], [101, 7, 300, 12]]
    runs = []
    for tp, pp in ((1, 1), (2, 2)):
        options = RuntimeOptions(demo, tp=tp, pp=pp, timeout=60, **{"num_speculative_tokens": 3, **DEMOS[demo]})
        with Engine(options) as engine:
            runs.append(engine.generate(prompts, 16))
    whole, sharded = runs
    assert sharded.tokens == whole.tokens
    assert sharded.row_metrics == whole.row_metrics and whole.metrics.num_accepted_tokens > 0
    assert sharded.proposals == whole.proposals


@pytest.mark.slow
def test_tp_4_pp_1_gives_tp_1s_tokens_and_acceptance_counts(tmp_path):
    """Four TP ranks of one stage: 2 KV heads replicated, each on two ranks (vLLM's rule); 300 rows of vocabulary
    padded to 320, the last rank's 80 rows holding 60 real ones."""
    make_hf_checkpoint(tmp_path, seed=5, **PADDED_VOCAB)
    runs = []
    for tp in (1, 4):
        with Engine(RuntimeOptions(str(tmp_path), tp=tp, num_speculative_tokens=3, timeout=60)) as engine:
            runs.append(engine.generate(PIPELINE_PROMPTS, 12))
    assert runs[1].tokens == runs[0].tokens and runs[1].row_metrics == runs[0].row_metrics
    assert runs[1].proposals == runs[0].proposals and len(runs[0].proposals) > 3 * len(PIPELINE_PROMPTS)


@pytest.mark.slow
def test_a_draft_model_at_tp_2_pp_2_gives_tp_1_pp_1s_tokens_and_drafts(tmp_path):
    """A separate draft model (the target's first two layers, saved again by transformers) is sharded as the target
    is: the same TP size, on the last stage."""
    target = save_target(tmp_path / "target")
    draft = save_cut_down(target, tmp_path / "draft", num_hidden_layers=2)
    runs = []
    for tp, pp in ((1, 1), (2, 2)):
        options = RuntimeOptions(str(target), speculative_model=str(draft), tp=tp, pp=pp, num_speculative_tokens=3)
        with Engine(options) as engine:
            runs.append(engine.generate(PIPELINE_PROMPTS, 12))
    whole, sharded = runs
    assert sharded.tokens == whole.tokens and sharded.proposals == whole.proposals
    assert sharded.row_metrics == whole.row_metrics and whole.metrics.num_accepted_tokens > 0


@pytest.mark.slow
def test_seeded_sampling_at_tp_2_gives_tp_1s_tokens_and_counters():
    """At temperature 1 every TP rank of the last stage samples and verifies (rejection sampling) alike: the seeded
    rows draw what TP 1 draws, so tokens, drafts and counters are TP 1's."""
    prompts = [[5, 9, 14, 3, 77, 41, 8, 19], [101, 7, 300, 12]]
    sampling = SamplingParams(temperature=1.0, seed=11)
    runs = []
    for tp in (1, 2):
        with Engine(RuntimeOptions("demo", tp=tp, pp=2, num_speculative_tokens=3, timeout=60)) as engine:
            runs.append(engine.generate(prompts, 24, sampling))
    assert runs[1].tokens == runs[0].tokens and runs[1].proposals == runs[0].proposals
    assert runs[1].row_metrics == runs[0].row_metrics and runs[0].metrics.num_accepted_tokens > 0


@pytest.mark.slow
def test_compiled_tp_2_gives_eager_tp_1s_tokens_and_drafts():
    """--compile traces the layers with their all-reduces and all-gathers in them."""
    prompts = [[5, 9, 14, 3, 77, 41, 8, 19]]
    runs = []
    for tp, compiled in ((1, False), (2, True)):
        options = RuntimeOptions("demo", tp=tp, compile=compiled, num_speculative_tokens=3, timeout=120)
        with Engine(options) as engine:
            runs.append(engine.generate(prompts, 16))
    assert runs[1].tokens == runs[0].tokens and runs[1].proposals == runs[0].proposals
    assert runs[1].row_metrics == runs[0].row_metrics


def test_the_memory_plan_counts_what_each_tp_rank_builds():
    """Every TP rank of every stage, built alone in its shapes: the bytes it holds are the plan's for that rank."""
    checkpoint = Checkpoint("demo")
    ranks = placements(checkpoint.config, 2, has_drafter=True)
    options = RuntimeOptions("demo", tp=2, pp=2, num_speculative_tokens=3)
    plan = plan_memory(checkpoint, ranks, drafter_kind(checkpoint, "demo", None), options, 9, 64)
    assert [rank.rank for rank in plan.ranks] == [0, 1, 2, 3]
    try:
        for rank in range(4):
            tensor_parallel.use(TensorParallel())  # as a fresh process: build_rank takes the rank's own shapes
            model, _ = build_rank(options, rank)
            held = held_bytes(model.stage) + (held_bytes(model.drafter) if model.drafter is not None else 0)
            assert held == plan.ranks[rank].weights, rank
    finally:
        tensor_parallel.use(TensorParallel())
    whole = plan_memory(checkpoint, ranks, drafter_kind(checkpoint, "demo", None), replace(options, tp=1), 9, 64)
    assert plan.ranks[2].weights + plan.ranks[3].weights >= whole.ranks[1].weights  # norms and routers replicated


def test_a_drafter_stage_built_alone_at_tp_2_says_its_tp_ranks_were_not_measured():
    """A model larger than the machine (here: a 1 MiB limit) gets the drafter's stage built alone, at TP 1: the
    per-TP-rank measurement did not run, so the verdict cannot be healthy."""
    options = CheckOptions(RuntimeOptions("demo", tp=2, pp=2, num_speculative_tokens=3), memory_limit=1 << 20)
    report = run_check(options, show_progress=False)
    assert not report.memory["fits"]
    skipped = [f.message for f in report.stages[0].findings if f.check == "runtime.skipped"]
    assert any("the per-TP-rank measurement did not run" in message for message in skipped)
    assert report.exit_code == 1


def test_inspect_shows_each_stages_ranks_and_what_vllm_refuses():
    from specdoctor.workflow.inspect import summarize

    checkpoint = Checkpoint("demo")
    summary = summarize(checkpoint, 2, drafter_kind(checkpoint, "demo", None), tp=2)
    assert [row["ranks"] for row in summary["placement"]] == [[0, 1], [2, 3]]
    assert "placement.tensor_parallel" not in {finding["check"] for finding in summary["preflight"]}
    findings = summarize(checkpoint, 1, drafter_kind(checkpoint, "demo", None), tp=4)["preflight"]
    refused = [f["message"] for f in findings if f["check"] == "placement.tensor_parallel"]
    assert refused == ["TP 4: Total number of attention heads (6) must be divisible by tensor parallel size (4) "
                       "(vLLM's rule)"]  # fmt: skip


# vLLM's rules, worked out by hand: q/k/v, gate/up and MLA's q_b/kv_b split their rows evenly; o_proj and down_proj
# their columns; KV heads fewer than the ranks are replicated (rank r holds head r // (TP / heads)).
SHARDS = [
    ((8 * 16, 64), (4 * 16, 64), False, TensorParallel(1, 2), (0, 64, 128)),  # q_proj: heads 4..7
    ((64, 8 * 16), (64, 4 * 16), False, TensorParallel(1, 2), (1, 64, 128)),  # o_proj: its input columns
    ((2 * 16, 64), (16, 64), False, TensorParallel(3, 4), (0, 16, 32)),  # 2 KV heads, 4 ranks: rank 3 holds head 1
    ((2 * 16, 64), (16, 64), False, TensorParallel(1, 4), (0, 0, 16)),  # rank 1 holds head 0
    ((300, 64), (160, 64), True, TensorParallel(1, 2), (0, 160, 300)),  # a vocabulary: 20 padding rows past 300
    ((64,), (64,), False, TensorParallel(1, 2), None),  # a norm: replicated
]


@pytest.mark.parametrize("full, local, vocab, tp, expected", SHARDS)
def test_shard_ranges_follow_vllms_splits(full, local, vocab, tp, expected):
    assert shard_range(full, local, vocab, tp) == expected


def test_vocabulary_ranges_of_real_vocabularies_split_as_vllm_pads_them():
    assert vocab_shard_range(129_280, 4, 3) == (96_960, 129_280)  # DeepSeek-V3: 2,020 x 64
    assert vocab_shard_range(151_936, 8, 7) == (132_944, 151_936)  # Qwen3: 2,374 x 64
    assert vocab_shard_range(202_752, 4, 1) == (50_688, 101_376)  # GLM-4.5
    with pytest.raises(SpecdoctorError, match="does not split over 3"):
        vocab_shard_range(151_936, 3, 0)
