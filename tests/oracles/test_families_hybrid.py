"""The hybrid families (Qwen3-Next, Qwen3.5-MoE, Qwen3.5 dense: Gated DeltaNet + gated attention, `mtp.*`
drafter) on checkpoints transformers saved, against transformers' own classes: logits at every position,
greedy tokens through the cache against `generate`, the MTP step against transformers' layers; the
recurrent state's rollback after rejected drafts, tensor by tensor; then the pipeline runtime at PP 2-4
against PP 1, speculative against plain greedy, and an engine without rollback diverging."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from torch._dynamo.utils import counters

from specdoctor.runtime.cache.kv_cache import new_cache
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.decode.pipeline import prompt_logits
from specdoctor.runtime.models.qwen3_next import ARCHITECTURES
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.workflow.check import run_check
from specdoctor.workflow.inspect import summarize
from tests.helpers.families import (
    assert_pipeline_matches_single_process,
    checkpoints_by_architecture,
    make_family_checkpoint,
    saved_tensors,
)
from tests.helpers.loading import mtp_step_error
from tests.helpers.reference_decoder import greedy_generate
from tests.oracles.test_model_parity import assert_matches_transformers, full_stage, logits_error, relative_error
from tests.workflow.test_check import check_options


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory):
    """{architecture: (directory, transformers model)}."""
    return checkpoints_by_architecture(tmp_path_factory, ARCHITECTURES)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_logits_and_greedy_tokens_through_the_recurrent_state_match_transformers(hybrid_models, architecture):
    assert_matches_transformers(*hybrid_models[architecture])


@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"])
def test_batched_prompts_of_different_lengths_equal_one_at_a_time(hybrid_models, architecture):
    """Right padding runs through the recurrent layers too: it must leave each row's state as its last token left it."""
    stage = full_stage(hybrid_models[architecture][0])
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (3, 9, 6)]
    assert greedy_generate(stage, prompts, 16) == [greedy_generate(stage, [p], 16)[0] for p in prompts]


def test_qwen3_next_sparse_step_and_dense_layers_match_transformers(tmp_path):
    """Qwen3-Next's MoE placement: every second layer MoE, layer 0 forced dense, unnormalised top-k."""
    model = make_family_checkpoint(
        tmp_path, "Qwen3NextForCausalLM", seed=3, decoder_sparse_step=2, mlp_only_layers=[1], norm_topk_prob=False
    )
    assert logits_error(tmp_path, model, batch=2, length=13, seed=2) < 1e-4


def transformers_mtp_logits(path, tokens, prev_hidden, positions):
    """One MTP step built from transformers' own layers: the checkpoint's `mtp.layers.0.*` loaded by
    `from_pretrained` as the single full-attention layer of a one-layer model of the family (transformers'
    key conversions fuse its experts), its RMSNorm class for `mtp.pre_fc_norm_*` and `mtp.norm`, then
    fc(cat(norm(embed), norm(hidden))), the layer, the norm and the target's lm_head (vLLM's wiring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    tensors = saved_tensors(path, "")
    staged = path.parent / f"{path.name}-mtp-as-layer"
    staged.mkdir(exist_ok=True)
    layer = {key.replace("mtp.layers.0.", "model.layers.0."): v for key, v in tensors.items() if "mtp.layers.0." in key}
    own = {key: tensors[key] for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    save_file({**layer, **own}, str(staged / "model.safetensors"))
    one_layer = {**config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"], "mlp_only_layers": []}
    (staged / "config.json").write_text(json.dumps(one_layer))
    model = AutoModelForCausalLM.from_pretrained(staged).eval()
    norm_class = type(model.model.norm)

    def norm(key):
        module = norm_class(config.hidden_size, eps=config.rms_norm_eps)
        module.weight.data.copy_(tensors[key])
        return module

    embeds = model.model.embed_tokens(tokens)
    fc_input = torch.cat(
        [norm("mtp.pre_fc_norm_embedding.weight")(embeds), norm("mtp.pre_fc_norm_hidden.weight")(prev_hidden)], -1
    )
    hidden = torch.nn.functional.linear(fc_input, tensors["mtp.fc.weight"])
    hidden = model.model.layers[0](
        hidden,
        position_embeddings=model.model.rotary_emb(hidden, positions),
        attention_mask=None,
        position_ids=positions,
    )
    return model.lm_head(norm("mtp.norm.weight")(hidden))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_mtp_step_matches_transformers_layers(hybrid_models, architecture):
    error, provenance = mtp_step_error(*hybrid_models[architecture], transformers_mtp_logits, first_position=0)
    assert not provenance.unfilled() and error < 1e-4
    assert provenance.labels()["layers.0.fc.weight"] == "checkpoint:mtp.fc.weight"
    assert provenance.labels()["layers.0.shared_head.head.weight"] == "alias:lm_head"


def run_prompt(stage, cache, prompts):
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    lengths = torch.tensor([len(p) for p in prompts])
    cache.begin(valid_end=lengths, keep_positions=False)
    stage(ids, torch.arange(ids.shape[1]).expand(len(prompts), -1), cache)
    cache.commit(lengths - 1, torch.ones(len(prompts), dtype=torch.bool))
    return lengths


@pytest.mark.parametrize("architecture", ["Qwen3NextForCausalLM", "Qwen3_5ForCausalLM"])
@pytest.mark.parametrize("rollback", [True, False])
def test_state_after_a_rejected_step_equals_a_run_that_never_saw_the_rejected_tokens(
    hybrid_models, architecture, rollback
):
    """A verification pass of 5 tokens per row, of which rows keep 1, 3 and all 5 (accepted 0, 2, 4): the
    committed conv windows and delta-rule states equal, tensor by tensor, those of a run fed only the kept
    tokens. Without rollback (an engine that keeps every verified token) the rows that rejected differ."""
    stage = full_stage(hybrid_models[architecture][0])
    config = stage.config
    prompts = [[5, 9, 14, 3, 77], [101, 7], [12, 13, 14, 15, 16, 17, 18]]
    verified = torch.tensor([[40, 41, 42, 43, 44], [50, 51, 52, 53, 54], [60, 61, 62, 63, 64]])
    accepted = torch.tensor([0, 2, 4])
    with torch.no_grad():
        cache = new_cache(config, stage.layer_ids, 3, 32, torch.float32, "cpu", rollback=rollback)
        lengths = run_prompt(stage, cache, prompts)
        cache.begin(valid_end=None, keep_positions=True)
        stage(verified, lengths[:, None] + torch.arange(5), cache)
        cache.commit(accepted, torch.ones(3, dtype=torch.bool))
        kept = [
            prompt + verified[row, : n + 1].tolist()
            for row, (prompt, n) in enumerate(zip(prompts, accepted, strict=True))
        ]
        fresh = new_cache(config, stage.layer_ids, 3, 32, torch.float32, "cpu")
        run_prompt(stage, fresh, kept)
    linear_layers = [i for i in stage.layer_ids if config.is_linear_attention(i)]
    assert linear_layers and cache.states.conv.keys() == set(linear_layers)
    # The two runs batch their matmuls differently, so equal means equal to float rounding (relative 1e-5);
    # a state that kept a rejected token is off by far more than that (relative 1e-2 at least).
    for layer in linear_layers:
        for row in range(3):
            errors = [
                relative_error(ours[layer][row], theirs[layer][row])
                for ours, theirs in (
                    (cache.states.conv, fresh.states.conv),
                    (cache.states.recurrent, fresh.states.recurrent),
                )
            ]
            if rollback or accepted[row] == 4:
                assert max(errors) < 1e-5, (layer, row, errors)
            else:
                assert min(errors) > 1e-2, (layer, row, errors)


@pytest.mark.parametrize("architecture, pp", list(zip(ARCHITECTURES, (2, 3, 4), strict=True)))
def test_pipeline_matches_single_process_and_speculation_is_lossless(hybrid_models, architecture, pp):
    assert_pipeline_matches_single_process(*hybrid_models[architecture], pp, ks=range(1, 6))


FAULTS = [  # (architecture, PP, embedding policy, head policy, fill): each architecture a different fault
    ("Qwen3NextForCausalLM", 4, "engine-legacy", "engine-legacy", "nan"),
    ("Qwen3_5MoeForCausalLM", 2, "alias-placeholder", "fixed", "empty"),
    ("Qwen3_5ForCausalLM", 2, "fixed", "unloaded", "zeros"),
]


@pytest.mark.parametrize("architecture, pp, policy, head, fill", FAULTS, ids=["legacy-nan", "alias", "unloaded-head"])
def test_check_finds_and_repairs_the_broken_drafter(hybrid_models, architecture, pp, policy, head, fill):
    """The `mtp.*` layout ships no own embedding, so at PP > 1 the legacy loading (SGLang's Qwen3.5 MTP
    before PR #37471) leaves it unfilled on the last rank (the head is `lm_head` in every engine), an alias
    takes the first rank's placeholder (the first draft step fails), and a forced unloaded head holds its
    fill. Content finds each; the repair reads the target's tensors and the battery passes after it. The
    drafter is random: acceptance is not asserted."""
    path = str(hybrid_models[architecture][0])
    report = run_check(check_options(path, pp, None, 3, policy, head, fill, repair=True), False)
    before, after = report.stages
    assert before.signals()["content"], before.findings
    assert before.behaviour["battery"] == ("crashed" if policy == "alias-placeholder" else "9/9")
    assert report.repair.repaired and after.signals()["content"] == [] and after.behaviour["battery"] == "9/9"
    assert after.drafter["provenance"]["embed_tokens.weight"] in (
        "alias:model.embed_tokens",
        "checkpoint:model.embed_tokens.weight",
    )
    assert after.drafter["provenance"]["layers.0.shared_head.head.weight"] in (
        "alias:lm_head",
        "checkpoint:lm_head.weight",
    )


def test_check_names_a_missing_rollback_and_only_on_the_engine_that_lacks_it(hybrid_models):
    """An engine that keeps every verified token in the recurrent state: its target-only output (one token a
    step, nothing to roll back) is right and its speculative output diverges, which check names."""
    path = str(hybrid_models["Qwen3NextForCausalLM"][0])
    healthy = run_check(check_options(path, 1, None, 3, "fixed", "fixed"), False).stages[0]
    options = check_options(path, 1, None, 3, "fixed", "fixed")
    broken_options = dataclasses.replace(options, runtime=dataclasses.replace(options.runtime, state_rollback="broken"))
    broken = run_check(broken_options, False).stages[0]
    names = lambda stage: {finding.check for finding in stage.findings}  # noqa: E731
    assert healthy.behaviour["battery"] == "9/9" and "behaviour.state_rollback" not in names(healthy)
    assert broken.behaviour["battery"] != "9/9" and "behaviour.state_rollback" in names(broken)
    assert broken.signals()["content"] == []  # the weights are right: only behaviour shows it


@pytest.mark.parametrize(
    "architecture, pp, warned",
    [("Qwen3NextForCausalLM", 2, True), ("Qwen3NextForCausalLM", 1, False), ("Qwen3_5MoeForCausalLM", 2, False)],
)
def test_preflight_warns_where_vllms_qwen3_next_drafter_fails_past_pp1(hybrid_models, architecture, pp, warned):
    """vLLM 0.32's Qwen3-Next drafter takes its inputs only on the first PP rank, so at PP > 1 (where it runs on
    the last) its first draft step asserts; Qwen3.5's branches on its inputs."""
    summary = summarize(Checkpoint(hybrid_models[architecture][0]), pp)
    assert ("placement.drafter_rank" in {finding["check"] for finding in summary["preflight"]}) == warned


def test_compiled_prompt_passes_through_the_recurrence_stay_eager(hybrid_models, tmp_path, monkeypatch):
    """Gated DeltaNet steps through a prompt's positions in Python: under --compile each prompt length would trace
    a graph of its own, so its prompt passes run eager (and give the eager logits)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # compile_layers sets it; restored after
    path = str(hybrid_models["Qwen3NextForCausalLM"][0])
    compiled, _ = load_rank(RuntimeOptions(path, compile=True), 0)
    eager, _ = load_rank(RuntimeOptions(path), 0)
    graphs = counters["stats"]["unique_graphs"]
    prompts = [[list(range(3, 3 + length))] for length in (10, 13)]
    logits = [prompt_logits(compiled, prompt) for prompt in prompts]
    compiled.finish_compiles()
    assert counters["stats"]["unique_graphs"] == graphs and compiled.graphs.status.requested == len(
        compiled.graphs.modules
    )
    for prompt, got in zip(prompts, logits, strict=True):
        torch.testing.assert_close(got, prompt_logits(eager, prompt))
