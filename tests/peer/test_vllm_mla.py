"""vLLM 0.32's CPU build as the oracle for the MLA family: on DeepSeek-V3 and GLM-4.7-Flash checkpoints
transformers saved (with the MTP layer in the hub layout), every prompt gives the same token ids, drafts
and accepted counts in vLLM (MTP, PP 1) as in specdoctor's runtime. vLLM's CPU build refuses sparse
attention, so DeepSeek-V3.2 and GLM-5 have no vLLM oracle here."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from tests.helpers.families import make_family_checkpoint
from tests.oracles.test_families_mla import YARN
from tests.peer.conftest import K

pytestmark = [pytest.mark.timeout(900), pytest.mark.tool_env("vllm")]
MAX_TOKENS = 32
# vLLM's CPU MLA kernels take DeepSeek's own head sizes only (latent 512 + rotary 64); YaRN as DeepSeek-V3
# configures it. Small elsewhere: hidden 128, two heads.
PEER_MLA = dict(
    hidden_size=128, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=96, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rope_parameters=YARN,
)  # fmt: skip


def make_repeating_drafter(path, hidden: int) -> None:
    """Rewrite the random MTP layer so that it drafts the token the target just produced: its block adds
    nothing (attention and MLP outputs zeroed), eh_proj passes the target's hidden state through, and its
    norms are plain, so its logits are a positive multiple of the target's. Drafts are then accepted
    wherever the target repeats a token, which random models often do: acceptance counts that are not
    all zero, from an MTP layer both engines run as they run any other."""
    shard = path / "model-mtp.safetensors"
    tensors = load_file(str(shard))
    for key, value in tensors.items():
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[key] = torch.zeros_like(value)
        elif key.endswith(("hnorm.weight", "shared_head.norm.weight")):
            tensors[key] = torch.ones_like(value)
        elif key.endswith("eh_proj.weight"):  # input: [embedding, hidden state]
            tensors[key] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    save_file(tensors, str(shard))


def vllm_rows(vllm_python, model, prompts: list[list[int]]) -> list[dict]:
    script = [str(vllm_python), "tests/peer/vllm_mla_run.py", str(model), str(K), str(MAX_TOKENS), json.dumps(prompts)]
    result = subprocess.run(script, capture_output=True, text=True, timeout=600, env=os.environ)
    line = next((row for row in result.stdout.splitlines() if row.startswith("RESULT ")), None)
    assert line, result.stderr[-2000:]
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize("architecture", ["DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"])
def test_every_prompt_gives_vllms_tokens_drafts_and_accepted_counts(vllm_python, tmp_path, architecture):
    make_family_checkpoint(tmp_path, architecture, seed=1, **PEER_MLA)
    make_repeating_drafter(tmp_path, PEER_MLA["hidden_size"])
    # No EOS on either side: vLLM runs without a tokenizer (so it never stops at one), and neither does ours.
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 320, (length,), generator=generator).tolist() for length in (1, 2, 5, 9, 17, 30)]
    theirs = vllm_rows(vllm_python, tmp_path, prompts)
    with Engine(RuntimeOptions(str(tmp_path), num_speculative_tokens=K)) as engine:
        ours = [engine.generate([ids], MAX_TOKENS) for ids in prompts]
    for ids, mine, their in zip(prompts, ours, theirs, strict=True):
        assert len(mine.tokens[0]) == MAX_TOKENS and mine.tokens[0] == their["tokens"], ids
        counters = mine.row_metrics[0].to_dict()
        for counter in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
            assert counters[counter] == their[counter], (ids, counter, counters, their)
    # Accepted at every draft position, not only zeros.
    assert all(sum(row["num_accepted_tokens_per_pos"][position] for row in theirs) > 0 for position in range(K))
