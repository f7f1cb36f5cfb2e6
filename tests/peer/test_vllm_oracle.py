"""vLLM 0.32's CPU build as the oracle: per battery prompt the same token ids, drafts and accepted counts
as specdoctor's runtime; vLLM's own partition, vocabulary-sharding and placement code as goldens; and
`specdoctor probe` judging live vLLM deployments, healthy and broken."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest

from specdoctor.battery import load_battery
from specdoctor.checks.preflight import ranks_without_moe_layer
from specdoctor.errors import SpecdoctorError
from specdoctor.probe.acceptance_sweeps import PREFIX_MAX_TOKENS
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import TextCodec
from specdoctor.runtime.decode.grammar import GrammarRequest
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.models.registry import read_config
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.partition import layer_ranges, placements
from specdoctor.runtime.sharding import shard_range, vocab_shard_range
from specdoctor.runtime.tensor_parallel import TensorParallel
from tests.helpers.checkpoints import zeroed_enorm_copy
from tests.helpers.servers import SpecdoctorServer, free_port
from tests.peer.conftest import REASONING, K, start_or_fail
from tests.peer.vllm_server import VllmServer, completion_with_counters

# vLLM's start-up (80-100 s on 2 cores) runs inside a test's fixtures; the install runs before the suite.
pytestmark = [pytest.mark.timeout(900), pytest.mark.tool_env("vllm")]
MAX_TOKENS = 32
GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}


def assert_battery_matches(server, runtime: RuntimeOptions, structured: dict | None = None) -> None:
    """Per battery prompt, sent alone: vLLM's token ids and its draft and acceptance counters are ours. `structured`:
    vLLM's structured_outputs for every prompt, and the same grammar for ours (vLLM names the EOS token that ends a
    reply as its last token id; ours ends without it)."""
    checkpoint = Checkpoint(runtime.model)
    codec = TextCodec(checkpoint.path / "tokenizer.json", checkpoint.config.eos_token_ids)
    prompts = [(entry["name"], codec.encode(entry["prompt"])) for entry in load_battery(None)]
    grammar = GrammarRequest("json", json.dumps(structured["json"])) if structured else None
    with Engine(runtime) as engine:
        ours = {name: engine.generate([ids], MAX_TOKENS, grammar=grammar) for name, ids in prompts}
        eos = engine.eos_token_ids
    stopped = 0
    for name, ids in prompts:
        extra = {"structured_outputs": structured} if structured else None
        tokens, metrics = completion_with_counters(server.url, ids, MAX_TOKENS, extra)
        if ours[name].finish_reasons[0] == "stop" and tokens and tokens[-1] in eos:
            tokens, stopped = tokens[:-1], stopped + 1
        assert tokens == ours[name].tokens[0], name
        theirs, mine = metrics.to_dict(), ours[name].row_metrics[0].to_dict()
        for counter in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
            assert theirs[counter] == mine[counter], (name, counter, theirs, mine)
        assert mine["num_drafts"] > 0, name
    if structured:
        assert stopped > 0  # some replies closed their JSON inside MAX_TOKENS: the grammar's end was reached


def test_every_battery_prompt_gives_vllms_tokens_drafts_and_accepted_counts(vllm_demo):
    assert_battery_matches(vllm_demo, RuntimeOptions("demo", num_speculative_tokens=K))


def test_structured_output_gives_vllms_tokens_drafts_and_accepted_counts(vllm_demo):
    """vLLM's xgrammar under MTP: its drafts validated against the grammar, each verified position masked, the
    matcher rolled back. Under a JSON schema every battery prompt gives vLLM's tokens and its counters: the drafts
    the grammar rules out are counted and rejected as vLLM counts and rejects them."""
    assert_battery_matches(vllm_demo, RuntimeOptions("demo", num_speculative_tokens=K), {"json": GRAMMAR_SCHEMA})


def test_at_tp_2_every_battery_prompt_gives_vllms_tokens_drafts_and_accepted_counts(vllm_demo_tp2):
    """vLLM's CPU build at TP 2 (two workers) against our two TP rank processes: same tokens, same counters."""
    assert_battery_matches(vllm_demo_tp2, RuntimeOptions("demo", tp=2, num_speculative_tokens=K))


def test_an_eagle3_head_gives_vllms_tokens_drafts_and_accepted_counts(vllm_eagle3):
    """demo-eagle3's trained head: its aux states, fc, first layer over [embedding, state] and head."""
    runtime = RuntimeOptions("demo-eagle3", speculative_method="eagle3", num_speculative_tokens=K)
    assert_battery_matches(vllm_eagle3, runtime)


def test_a_draft_model_gives_vllms_tokens_drafts_and_accepted_counts(vllm_draft_model, demo_draft_model):
    """A two-layer cut of demo-dspark's target drafting for it with its own KV cache."""
    draft = dict(speculative_model=str(demo_draft_model), speculative_method="draft_model")
    runtime = RuntimeOptions("demo-dspark", num_speculative_tokens=K, **draft)
    assert_battery_matches(vllm_draft_model, runtime)


@pytest.fixture(scope="module")
def goldens(vllm_python, tmp_path_factory):
    tied = tmp_path_factory.mktemp("tied_demo")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / name, tied / name)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    script = [str(vllm_python), "tests/peer/vllm_goldens.py", str(DEMO_DIR), str(tied), str(free_port())]
    result = subprocess.run(
        script,
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    line = next((row for row in result.stdout.splitlines() if row.startswith("GOLDENS ")), None)
    assert line, result.stderr[-2000:]
    return json.loads(line.removeprefix("GOLDENS ")), tied


def test_penalties_at_every_verified_position_are_vllms(goldens):
    """Presence, frequency and repetition penalties (each alone, then all three, both signs of logits) at the k draft
    positions and the bonus one: our logits equal those vLLM's samplers verify against, each position penalised for
    the committed output and the drafts before it. Counting the committed output alone at every position (the
    penalties-per-step fault) gives other logits."""
    import torch

    from specdoctor.runtime.decode.adjustments import LogitAdjustments, adjusted_logits
    from specdoctor.runtime.decode.requests import SequenceRequest
    from tests.peer.vllm_goldens import PENALTY_CASES, PENALTY_DRAFTS, PENALTY_OUTPUT, PENALTY_PROMPT

    golden = goldens[0]["penalties"]
    logits, drafts = torch.tensor(golden["logits"])[None], torch.tensor([PENALTY_DRAFTS])
    for name, (presence, frequency, repetition) in PENALTY_CASES.items():
        wanted = LogitAdjustments((), 0, repetition, frequency, presence)
        sequence = SequenceRequest(PENALTY_PROMPT, 16, adjustments=wanted)
        ours = adjusted_logits(logits, [sequence], [PENALTY_OUTPUT], drafts)[0]
        torch.testing.assert_close(ours, torch.tensor(golden["cases"][name]), rtol=0, atol=1e-6, msg=name)
        per_step = adjusted_logits(logits, [sequence], [PENALTY_OUTPUT], drafts, per_step=True)[0]
        assert not torch.allclose(per_step, ours), name


def test_partition_matches_vllms_get_pp_indices(goldens, monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for key, ranks in goldens[0]["pp"]["grid"].items():
        layers, pp = map(int, key.split(","))
        assert [[r.start, r.stop] for r in layer_ranges(layers, pp)] == ranks, key
    for key, ranks in goldens[0]["pp"]["explicit"].items():
        layers, pp, spec = key.split(",", 2)
        if ranks == "error":
            with pytest.raises(SpecdoctorError):
                layer_ranges(int(layers), int(pp), spec)
        else:
            assert [[r.start, r.stop] for r in layer_ranges(int(layers), int(pp), spec)] == ranks, key


def test_vocab_shards_match_vllms_vocab_parallel_embedding(goldens):
    for key, ranks in goldens[0]["vocab"].items():
        vocab, tp = map(int, key.split(","))
        if ranks == "error":
            with pytest.raises(SpecdoctorError, match="does not split"):
                vocab_shard_range(vocab, tp, 0)
        else:
            assert [list(vocab_shard_range(vocab, tp, rank)) for rank in range(tp)] == ranks, key


def rows_of(shard, total: int) -> list[int]:
    """The checkpoint rows (or columns) a (dim, start, end) slice from shard_range covers; None: all of them."""
    start, end = (0, total) if shard is None else shard[1:]
    return list(range(start, end))


def test_tp_slices_match_what_vllms_own_weight_loaders_put_on_each_rank(goldens):
    """QKVParallelLinear (KV heads split, and replicated when fewer than ranks), MergedColumnParallelLinear,
    RowParallelLinear and VocabParallelEmbedding (padding rows zero), at TP 2 and 4, every rank."""
    checked = set()
    for key, held in goldens[0]["tp"].items():
        kind, *sizes = key.split(",")
        *shape, tp_size, rank = map(int, sizes)
        tp = TensorParallel(rank, tp_size)
        if kind == "qkv":
            heads, kv_heads, size, hidden = shape
            local_kv = max(1, kv_heads // tp_size)
            for shard, total, local in (
                ("q", heads, heads // tp_size),
                ("k", kv_heads, local_kv),
                ("v", kv_heads, local_kv),
            ):
                ours = shard_range((total * size, hidden), (local * size, hidden), False, tp)
                assert rows_of(ours, total * size) == held[shard], (key, shard)
        elif kind in ("gate", "row"):
            rows, columns = shape
            full, local = (
                ((rows, columns), (rows // tp_size, columns))
                if kind == "gate"
                else ((rows, columns), (rows, columns // tp_size))
            )
            ours = shard_range(full, local, False, tp)
            assert rows_of(ours, full[0] if kind == "gate" else full[1]) == held, key
        else:
            vocab, hidden = shape
            start, end = vocab_shard_range(vocab, tp_size, rank)
            ours = shard_range((vocab, hidden), (end - start, hidden), True, tp)
            assert rows_of(ours, vocab) == held["rows"] and (end - start) - len(held["rows"]) == held["padding"], key
        checked.add(kind)
    assert checked == {"qkv", "gate", "row", "vocab"}


def test_placement_matches_what_vllms_glm_model_builds_on_each_rank(goldens):
    vllm, tied = goldens
    for name, path in (("untied", DEMO_DIR), ("tied", tied)):
        config = read_config(json.loads((path / "config.json").read_text()))
        for pp in range(1, 5):
            ranks = placements(config, pp)
            refused = ranks_without_moe_layer(config, ranks)
            ours = [
                {
                    "layers": [r.layers.start, r.layers.stop],
                    "has_embedding": r.has_embedding,
                    "has_head": r.has_head,
                    "refuses_without_moe_layer": r.rank in refused,
                }
                for r in ranks
            ]
            assert ours == vllm["placement"][f"{name},{pp}"], (name, pp)


def test_dspark_taps_and_mask_token_match_vllms_own_functions(goldens):
    """The aux layers vLLM's target captures for a DSpark or DFlash config (ids + 1, sorted, de-duplicated;
    the speculators format converted as vLLM converts it), its mask token, and how many of them reach each PP
    rank from upstream, against the runtime's."""
    from specdoctor.runtime.drafter.taps import tap_route
    from specdoctor.runtime.models.dspark import read_dspark_config
    from specdoctor.runtime.options import TapPolicy
    from tests.helpers.dspark import drafter_fields

    dspark = goldens[0]["dspark"]
    for case in dspark["configs"]:
        fields = {**drafter_fields(), **case["fields"], "vocab_size": 320}
        for name in ("target_layer_ids", "mask_token_id"):
            if name not in case["fields"]:
                fields.pop(name)
        if "speculators_model_type" in fields:  # the layers' sizes live under transformer_layer_config there
            fields = {**case["fields"], "transformer_layer_config": {**fields, **fields["transformer_layer_config"]}}
        if not case["sample_from_anchor"]:  # DFlash's 1 + N layout, which the runtime refuses
            with pytest.raises(SpecdoctorError, match="sample_from_anchor false"):
                read_dspark_config(fields)
            continue
        config = read_dspark_config(fields)
        assert list(config.tap_entries) == case["aux"], case
        assert config.mask_token_id == case["mask"], case
    for key, received in dspark["received"].items():  # "layers,partition...,entries...": one count per rank
        layers, *rest = (int(item) for item in key.split(","))
        partition, entries = ",".join(map(str, rest[: len(received)])), tuple(rest[len(received) :])
        config = read_config({**json.loads((DEMO_DIR / "config.json").read_text()), "num_hidden_layers": layers})
        ranks = placements(config, len(received), partition, has_drafter=True)
        for placement in ranks:
            route = tap_route(entries, TapPolicy.FIXED, placement, [r.layers for r in ranks])
            assert route.received == received[placement.rank], (key, placement.rank)


# The Llama layer the goldens' EAGLE-3 configs name, with the sizes a runnable config needs.
EAGLE3_LAYER = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320}  # fmt: skip


def test_eagle3_aux_layers_flags_and_d2t_match_vllms_own_functions(goldens):
    """vLLM's default aux layers, the layers and flags it reads from heads of both layouts, and where its
    compute_logits places a pruned head's logits, against the runtime's reading and its head."""
    import torch

    from specdoctor.runtime.models.eagle3 import Eagle3Drafter, aux_entries, engine_default_entries, read_eagle3_config

    eagle3 = goldens[0]["eagle3"]
    for layers, captured in eagle3["defaults"].items():
        assert list(engine_default_entries(int(layers))) == captured, layers
    for case in eagle3["configs"]:
        fields = case["fields"]
        if "transformer_layer_config" in fields:
            fields = {**fields, "transformer_layer_config": {**EAGLE3_LAYER, **fields["transformer_layer_config"]}}
        else:
            fields = {**EAGLE3_LAYER, **fields}
        config = read_eagle3_config(fields)
        for layers, default in eagle3["defaults"].items():
            assert list(aux_entries(config, int(layers))) == (case["aux"] or default), (case, layers)
        assert config.norm_before_fc == bool(case["norm_before_fc"]), case
        assert config.norm_before_residual == bool(case["norm_before_residual"]), case
        if "speculators_model_type" in case["fields"]:  # the class vLLM converts it to (the original names its own)
            assert config.architecture == case["architectures"][0], case
    d2t = eagle3["d2t"]
    head = {**EAGLE3_LAYER, "vocab_size": 16, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": len(d2t)}
    drafter = Eagle3Drafter(read_eagle3_config(head))
    drafter.d2t.copy_(torch.tensor(d2t))
    assert drafter.target_logits(torch.tensor(eagle3["logits"])).tolist() == eagle3["placed"]


def probe(url: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "specdoctor", "probe", "--url", url, *args, "--json", "-"]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_probe_passes_a_healthy_vllm_deployment(vllm_demo):
    result = probe(vllm_demo.url)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["source"] == "metrics" and report["metrics"]["mean_acceptance_length"] >= 2.0


def test_every_probe_sweep_runs_on_a_vllm_deployment_and_reports_what_it_found(vllm_demo, vllm_demo_plain):
    """vLLM's CPU build, the demo, MTP k 3, prefix caching on: every sweep runs. Context, concurrency, the prefix
    cache and the greedy comparison with speculation off (the reference: the same vLLM without speculation) pass.
    The prefix-cache sweep sizes its prompts from what
    the server caches: vLLM's CPU blocks are 128 tokens and with MTP it recomputes the last block it matched, so
    prompts under 257 tokens never hit. Sampling fails, and that is vLLM's (docs/probe.md §What vLLM 0.32
    showed): at temperature 1 it emits tokens its own reported distribution gives log-probabilities down to
    about -20 (chi-square p near 1e-16 over 1,024 tokens; without speculation it passes); at 0.6 and 0.8 with
    top-p 0.95, tokens outside that distribution's nucleus. The API sweep fails on seeds, vLLM's too. Prompt seed
    1: its prompt 13's stretch has a dense tail, and a prefix-cache prompt cut by its head's density ran past the
    server's 512 tokens (the sweep was "not run"); its cut is now searched as the server counts it."""
    args = ("--all", "--sampling", "600", "--sweep-prompts", "16", "--prompt-seed", "1")
    args += ("--reference-url", vllm_demo_plain.url)
    result = probe(vllm_demo.url, *args)  # 75 s on a quiet machine, several times that on a busy one
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr
    report = json.loads(result.stdout)
    sweeps = {sweep["name"]: sweep for sweep in report["sweeps"]}
    assert {name: sweep["status"] for name, sweep in sweeps.items()} == {
        "context": "passed",
        "prefix-cache": "passed",
        "concurrency": "passed",
        "sampling": "failed",
        "reference": "passed",
        "api": "failed",
    }, json.dumps({name: sweep["summary"] for name, sweep in sweeps.items()} | {"api": sweeps["api"]["points"]})
    assert len(sweeps["context"]["points"]) == 3  # 128, 256 and 432 tokens under vLLM's max_model_len of 512
    cached, total = re.search(r"cached: ([\d,]+) of ([\d,]+)", sweeps["prefix-cache"]["summary"]).groups()
    # Each prompt is cut by its own measured density to the length found (about 480 tokens here, in what 512 leaves
    # after its 16 generated), so every one of the 16 restores two of vLLM's 128-token blocks (cut by one mean
    # density, 9 of 16 fell under 257 tokens once)
    room = 512 - PREFIX_MAX_TOKENS
    assert int(cached.replace(",", "")) == 16 * 256 and int(total.replace(",", "")) <= 16 * room
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    # temperature 1 fails every run (p near 0); at the chat defaults vLLM also emits tokens outside the top-p
    # nucleus of its own reported distribution (6 of 288 at 0.6, 1 of 141 at 0.8 in one run), found most runs
    assert {f["check"] for f in errors} == {"probe.sampling", "probe.api"} and errors[0]["data"][
        "setting"
    ] == "temperature 1"
    assert errors[0]["data"]["p_value"] < 1e-6
    # The request API against vLLM without speculation: vLLM keeps max_tokens, stops, min_tokens, log-probabilities
    # and the penalties under MTP; it refuses logit_bias with speculation (400); a seeded request at temperature 0.8
    # is not reproducible with MTP (it is without: measured at concurrency 1 and 6, n 1 and 2; docs/probe.md). Its
    # structured output (xgrammar) under MTP: each finished json_schema, regex and choice reply valid, the same alone
    # as at 16 in flight, and the same as without speculation; with json_object the demo writes whitespace to the
    # limit, so nothing is judged. Behind its reasoning parser (`hf`), the schema starts after each chat reply's
    # thinking, inside a step's drafts too: the same replies as without speculation.
    api = {point["label"]: point for point in sweeps["api"]["points"]}
    verdicts = {name: point["verdict"] for name, point in api.items()}
    assert verdicts == {
        "max_tokens mid-run": "passed",
        "stop strings": "passed",
        "stop token ids": "passed",
        "min_tokens": "passed",
        "logprobs": "passed",
        "prompt_logprobs": "passed",
        "logit_bias": "not run",
        "presence_penalty 1.5": "passed",
        "frequency_penalty 1": "passed",
        "repetition_penalty 1.5": "passed",
        "response_format json_schema": "passed",
        "response_format json_object": "not run",  # the demo writes whitespace to the limit: nothing to judge
        "structured_outputs regex": "passed",
        "structured_outputs choice": "passed",
        "json_schema after reasoning": "passed",
        "seed": "failed",
    }
    assert "not yet supported with speculative decoding" in api["logit_bias"]["evidence"]
    assert [f["message"].split(":")[0] for f in errors if f["check"] == "probe.api"] == ["seed"]
    # vLLM's own running-requests gauge, sampled while each level ran
    assert all(isinstance(p["running_peak"], int) for p in sweeps["concurrency"]["points"])
    assert "running requests seen at most" in sweeps["concurrency"]["summary"]


@pytest.mark.parametrize("k", [3, 0])
def test_every_request_field_gives_vllms_tokens_on_serve_with_speculation_on_and_off(
    k, vllm_demo, vllm_demo_plain, thinking_demo
):
    """`serve` at k 3 against vLLM with MTP at k 3, and at k 0 against vLLM without speculation: the API sweep's
    requests (max_tokens, stop strings and ids, min_tokens, logprobs, prompt_logprobs, logit_bias, the three
    penalties, response_format and structured_outputs, a schema after a reasoning through both engines' `hf`
    reasoning parser, a seed), each compared token for token with vLLM's reply to the plain request (a field's
    effect is what that output implies) or to the same request (the penalties and the schema after a reasoning).
    json_object is not run: the demo writes whitespace to the limit on both engines."""
    reference = vllm_demo if k else vllm_demo_plain
    ours = SpecdoctorServer("--num-speculative-tokens", str(k), *REASONING, model=str(thinking_demo))
    try:
        result = probe(ours.url, "--api", "--reference-url", reference.url)
        stopped = [stopped_at_a_token_id(server.url) for server in (ours, reference)]
        named = [prompt_entry_names(server.url) for server in (ours, reference)]
        waited = [completion_after_a_reasoning(server.url) for server in (ours, reference)]
    finally:
        ours.stop()
    # each log-probability entry named as vLLM decodes it alone, an end-of-sequence id included
    assert named[0] == named[1] and "<|endoftext|>" in named[0], named
    # a completion whose prompt opens the thinking: the schema starts after its end on both
    assert waited[0] == waited[1] and not waited[0][1].lstrip().startswith("{"), waited
    # A reply ended by a stop token id: vLLM names the id as its last token, counts it in usage and gives it a
    # log-probability; serve the same
    assert stopped[0][:2] == stopped[1][:2] and stopped[0][2] == pytest.approx(stopped[1][2], abs=1e-4), stopped
    report = json.loads(result.stdout)
    errors = [finding["message"] for finding in report["findings"] if finding["severity"] == "error"]
    # At k 0 the errors say that the probed server does not speculate, so speculation was not compared
    not_speculating = ["speculative decoding is not enabled", "reference sweep not run"]
    assert [error.split(":")[0] for error in errors] == ([] if k else not_speculating), errors
    assert result.returncode == (0 if k else 1)
    (api,) = [sweep for sweep in report["sweeps"] if sweep["name"] == "api"]
    verdicts = {point["label"]: point["verdict"] for point in api["points"]}
    assert set(verdicts.values()) == {"passed", "not run"} and len(verdicts) == 16, verdicts
    assert [name for name, verdict in verdicts.items() if verdict == "not run"] == ["response_format json_object"]
    assert f"against {reference.url}" in api["summary"]


def prompt_entry_names(url: str) -> list[str]:
    """The names each prompt position's own log-probability entry gets, for a prompt of token ids with the
    end-of-sequence id inside it."""
    codec = TextCodec(DEMO_DIR / "tokenizer.json")
    ids = codec.encode("import os\n") + [codec.tokenizer.token_to_id("<|endoftext|>")] + codec.encode("def main(")
    body = {"model": "demo", "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    entries = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["prompt_logprobs"]
    return [entry[str(token)]["decoded_token"] for token, entry in zip(ids[1:], entries[1:], strict=True)]


def completion_after_a_reasoning(url: str) -> tuple[list[int], str]:
    """(token ids, text) of a completion under a JSON schema whose prompt is a chat turn that opens the thinking."""
    prompt = "user: class Parser:\nassistant:<think>"
    body = {"model": "demo", "prompt": prompt, "max_tokens": 48, "temperature": 0, "return_token_ids": True}
    body["structured_outputs"] = {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    return choice["token_ids"], choice["text"]


def stopped_at_a_token_id(url: str) -> tuple[list[int], int, list[float]]:
    """A greedy reply of 24 tokens, then the same request stopped at its 9th token's id: (token ids,
    usage.completion_tokens, log-probabilities) of the stopped reply."""
    body = {"model": "demo", "prompt": "class Parser:\n    def __init__(self", "max_tokens": 24, "temperature": 0}
    body |= {"return_token_ids": True, "logprobs": 1}
    plain = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["token_ids"]
    stop = plain[8]
    reply = httpx.post(f"{url}/v1/completions", json={**body, "stop_token_ids": [stop]}, timeout=120).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == stop, choice
    return choice["token_ids"], reply["usage"]["completion_tokens"], choice["logprobs"]["token_logprobs"]


def test_probe_finds_the_broken_drafter_of_a_vllm_deployment(vllm_python, tmp_path):
    # What a zero-filled drafter embedding does (measured on vLLM: mean 1.06, position rates 10/178, 1/178, 0).
    server = start_or_fail(lambda: VllmServer(zeroed_enorm_copy(DEMO_DIR, tmp_path / "broken", layer=4), K, eager=True))
    try:
        result = probe(server.url)
    finally:
        server.stop()
    assert result.returncode == 1, result.stdout + result.stderr
    findings = json.loads(result.stdout)["findings"]
    assert any(f["check"] == "probe.acceptance" and "drafter broken" in f["message"] for f in findings), findings
