"""The pipeline runtime on real processes (gloo): PP=N against PP=1, ownership, failures, torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdoctor.errors import PipelineError
from specdoctor.runtime.checkpoint.loader import load_target_stage
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.sampling import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.helpers.reference_decoder import greedy_generate
from tests.helpers.waiting import process_state, wait_for

PROMPTS = [[5, 9, 14, 3, 77], [101, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


def reference(path, prompts=PROMPTS, new_tokens=12):
    checkpoint = Checkpoint(path)
    stage = load_target_stage(checkpoint, range(checkpoint.config.num_hidden_layers), True, True)
    ids = torch.zeros(len(prompts), max(map(len, prompts)), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt)
    with torch.no_grad():
        logits = stage.logits(stage(ids, torch.arange(ids.shape[1]).expand(len(prompts), -1)))
    return greedy_generate(stage, prompts, new_tokens), logits


# "0,2,2,0": the first and the last rank own no layers, which vLLM allows.
@pytest.mark.parametrize("pp, partition", [(2, None), (2, "1,3"), (3, None), (4, None), (4, "0,2,2,0")])
def test_pipeline_matches_single_process(hf_checkpoint, pp, partition):
    path = hf_checkpoint[0]
    expected_tokens, expected_logits = reference(path)
    with Engine(RuntimeOptions(str(path), pp=pp, pp_partition=partition, timeout=30)) as engine:
        logits = engine.prompt_logits(PROMPTS)
        for row, prompt in enumerate(PROMPTS):
            n = len(prompt)
            torch.testing.assert_close(logits[row, :n], expected_logits[row, :n], rtol=1e-4, atol=1e-5)
        assert engine.generate(PROMPTS, 12).tokens == expected_tokens
        for k in (1, 4):  # the random drafter never agrees, so this exercises every rejection path
            result = engine.generate(PROMPTS, 12, num_speculative_tokens=k)
            assert result.tokens == expected_tokens
            assert result.metrics.num_draft_tokens == k * result.metrics.num_drafts > 0


def owned_keys(checkpoint: Checkpoint, info: dict) -> set[str]:
    start, stop = info["layers"]
    keys = {k for k in checkpoint.tensors if any(k.startswith(f"model.layers.{i}.") for i in range(start, stop))}
    if info["has_embedding"]:
        keys.add("model.embed_tokens.weight")
    if info["has_head"]:
        keys |= {"model.norm.weight", "lm_head.weight"}
    if info["has_drafter"]:
        keys |= {
            k
            for k in checkpoint.tensors
            if any(k.startswith(f"model.layers.{i}.") for i in checkpoint.config.mtp_layer_ids)
        }
        keys.add("model.embed_tokens.weight")  # the fixed policy reads the drafter's embedding
    return keys


def test_each_rank_reads_only_the_tensors_it_owns(hf_checkpoint):
    path = hf_checkpoint[0]
    checkpoint = Checkpoint(path)
    with Engine(RuntimeOptions(str(path), pp=3, timeout=30)) as engine:
        infos = engine.rank_info
    assert [info["layers"] for info in infos] == [[0, 1], [1, 3], [3, 4]]
    for info in infos:
        assert set(info["keys_read"]) == owned_keys(checkpoint, info), info["rank"]
    assert "model.embed_tokens.weight" not in infos[1]["keys_read"]
    assert infos[2]["drafter_provenance"]["embed_tokens.weight"] == "checkpoint:model.embed_tokens.weight"
    assert sum(info["bytes_read"] for info in infos) < 1.1 * sum(t.nbytes for t in checkpoint.tensors.values())


def test_tied_glm_embeddings_stay_on_the_first_rank_and_the_head_reads_them(tmp_path):
    """vLLM's GLM-4.5 MoE builds the embedding on the first rank only, tied or not; the last rank's
    head is the tied embedding tensor, and the fixed drafter reads its own copy from the checkpoint."""
    make_hf_checkpoint(tmp_path, seed=21, tie_word_embeddings=True)
    expected_tokens, _ = reference(tmp_path)
    with Engine(RuntimeOptions(str(tmp_path), pp=2, num_speculative_tokens=2, timeout=30)) as engine:
        assert not engine.rank_info[1]["has_embedding"] and engine.rank_info[1]["has_head"]
        assert "lm_head.weight" not in Checkpoint(tmp_path).tensors
        assert "model.embed_tokens.weight" in engine.rank_info[1]["keys_read"]
        assert engine.drafter_provenance["embed_tokens.weight"] == "checkpoint:model.embed_tokens.weight"
        assert engine.generate(PROMPTS, 12).tokens == expected_tokens


def make_agreeing_checkpoint(path, seed=22, **overrides):
    """Target and drafter whose logits are all zero: both always pick token 0, so every draft is accepted."""
    make_hf_checkpoint(path, seed=seed, **overrides)
    for shard in path.glob("*.safetensors"):
        tensors = load_file(str(shard))
        zeroed = {
            k: (torch.zeros_like(v) if k in ("model.norm.weight", "model.layers.4.shared_head.norm.weight") else v)
            for k, v in tensors.items()
        }
        save_file(zeroed, str(shard), metadata={"format": "pt"})


def test_full_agreement_accepts_every_draft_at_every_position(tmp_path):
    make_agreeing_checkpoint(tmp_path)
    with Engine(RuntimeOptions(str(tmp_path), pp=2, timeout=30)) as engine:
        for k in (1, 3, 5):
            result = engine.generate(PROMPTS, 13, num_speculative_tokens=k)
            metrics = result.metrics
            assert result.tokens == [[0] * 13] * 3
            assert metrics.num_accepted_tokens == metrics.num_draft_tokens
            assert metrics.mean_acceptance_length == k + 1
            assert metrics.per_position_rates == [1.0] * k


def test_seeded_sampling_is_reproducible(hf_checkpoint):
    with Engine(RuntimeOptions(str(hf_checkpoint[0]), pp=2, num_speculative_tokens=2, timeout=30)) as engine:
        sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7)
        first = engine.generate(PROMPTS, 10, sampling).tokens
        assert engine.generate(PROMPTS, 10, sampling).tokens == first
        other = engine.generate(PROMPTS, 10, SamplingParams(temperature=1.0, seed=8)).tokens
        assert other != first


def test_a_killed_rank_is_named_within_the_timeout(hf_checkpoint):
    with Engine(RuntimeOptions(str(hf_checkpoint[0]), pp=3, timeout=10)) as engine:
        os.kill(engine.rank_pids[1], signal.SIGKILL)
        wait_for(lambda: process_state(engine.rank_pids[1]), lambda state: state in (None, "Z"), 10, "rank 1 to die")
        start = time.time()
        with pytest.raises(PipelineError, match="rank 1") as caught:
            engine.generate(PROMPTS, 8)
        assert time.time() - start < 30
        assert "killed by signal 9" in str(caught.value)


def test_a_hung_rank_is_named_within_the_timeout(hf_checkpoint):
    engine = Engine(RuntimeOptions(str(hf_checkpoint[0]), pp=2, timeout=4))
    try:
        os.kill(engine.rank_pids[1], signal.SIGSTOP)
        wait_for(lambda: process_state(engine.rank_pids[1]), lambda state: state == "T", 10, "rank 1 to stop")
        start = time.time()
        with pytest.raises(PipelineError, match="rank 1"):
            engine.generate(PROMPTS, 8)
        assert time.time() - start < 25
    finally:
        os.kill(engine.rank_pids[1], signal.SIGCONT)
        engine.close()


def test_joins_a_group_launched_by_torchrun(hf_checkpoint, tmp_path):
    """torchrun starts the ranks (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 prints the result."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path / "model"
    shutil.copytree(hf_checkpoint[0], path)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(320)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    prompt = "w5 w9 w14 w3 w77"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "specdoctor",
        "generate",
        "--model",
        str(path),
        "--pp",
        "2",
        "--num-speculative-tokens",
        "2",
        "--prompt",
        prompt,
        "--max-tokens",
        "12",
        "--json",
        "-",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["outputs"][0]["tokens"] == reference(hf_checkpoint[0], [PROMPTS[0]])[0][0]
    assert report["metrics"]["num_drafts"] > 0


def test_a_stopped_pipeline_is_named_by_the_controller_deadline(hf_checkpoint):
    """Every rank stopped: no peer timeout can fire, so the controller's own deadline names them."""
    engine = Engine(RuntimeOptions(str(hf_checkpoint[0]), pp=2, timeout=2))
    try:
        for pid in engine.rank_pids:
            os.kill(pid, signal.SIGSTOP)
        states = lambda: [process_state(pid) for pid in engine.rank_pids]  # noqa: E731
        wait_for(states, lambda seen: seen == ["T", "T"], 10, "both ranks to stop")
        start = time.time()
        with pytest.raises(PipelineError, match=r"rank 0 \(pid \d+\), rank 1 \(pid \d+\) stopped"):
            engine.generate(PROMPTS, 8)
        assert engine.silence_limit_s < time.time() - start < engine.silence_limit_s + 5
    finally:
        for pid in engine.rank_pids:
            os.kill(pid, signal.SIGCONT)
        engine.close()


def test_the_first_rank_beats_once_a_second_unless_streaming():
    from specdoctor.runtime.decode.requests import GenerateResult
    from specdoctor.runtime.protocol import Reply
    from specdoctor.runtime.worker import StepReporter

    sent = []
    result = GenerateResult([[1, 2]], [""])
    quiet, streaming = StepReporter(lambda *m: sent.append(m), False), StepReporter(lambda *m: sent.append(m), True)
    for _ in range(3):
        quiet(result)
    assert sent == []  # steps within the first second: nothing to say
    quiet.last_beat -= 1.0
    quiet(result)
    assert sent == [(Reply.ALIVE, None)]
    streaming(result)
    assert sent[-1] == (Reply.PARTIAL, [[1, 2]])


def test_ranks_share_the_cores_less_those_left_to_the_controller():
    """Each rank's intra-op threads, as the ranks report them: the machine's cores over the ranks, less the cores
    the controller keeps (`serve` keeps one for its HTTP front, as vLLM's CPU workers keep one for its scheduler)."""
    cores = os.cpu_count() or 1
    with Engine(RuntimeOptions("demo", pp=2)) as engine:
        assert [info["threads"] for info in engine.rank_info] == [max(1, cores // 2)] * 2
    with Engine(RuntimeOptions("demo"), host_cores=1) as engine:
        assert engine.rank_info[0]["threads"] == max(1, cores - 1)
