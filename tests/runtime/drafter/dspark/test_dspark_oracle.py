"""One DSpark draft step against speculators' own DSparkDraftModel (its forward pass on a drafter it wrote):
the runtime's drafter, built by its drafter kind beside the target from speculators' checkpoint (read as vLLM
0.32 reads that format), gives the same logits for the same taps, prompt and anchor, with the taps taken from
transformers' Qwen3. Compared: the block's base logits (the backbone: context K/V from the fused taps, the
non-causal block, norm and head) and the Markov-biased logits along the greedy walk, with its drafts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.runtime.drafter.dspark.conftest import TOOL
from tests.tools.speculators_env import run_speculators

pytestmark = pytest.mark.tool_env("speculators")  # installed before the tests start (tests/conftest.py)

PROMPT = [3, 17, 101, 45, 9, 250, 77, 12, 5, 199, 64, 31]


def target_taps(target, entries: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """transformers' residual stream entering each layer in `entries` [T, taps, H], and the target's greedy
    token after the prompt: the block's anchor in the prompt pass."""
    import transformers

    model = transformers.Qwen3ForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), output_hidden_states=True)
    return torch.stack([out.hidden_states[entry][0] for entry in entries], dim=1), int(out.logits[0, -1].argmax())


def runtime_drafter(target, drafter_dir):
    from specdoctor.runtime.checkpoint.loader import load_full_target
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import open_drafter
    from specdoctor.runtime.options import RuntimeOptions

    checkpoint = Checkpoint(target)
    runtime = RuntimeOptions(str(target), speculative_model=str(drafter_dir))
    kind = open_drafter(checkpoint, runtime)
    drafter, _ = kind.build(load_full_target(checkpoint), runtime, torch.device("cpu"))
    return kind, drafter


def runtime_block(drafter, taps, anchor: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(base logits, Markov-biased logits along the greedy walk) [k, V] of the block after the prompt, the
    second through the engine's entry point (`draft`: context written at the prompt's positions, anchor next)."""
    length, positions = len(PROMPT), torch.arange(len(PROMPT))[None]
    with torch.no_grad():
        cache = drafter.new_cache(1, length + k, taps.dtype, taps.device)
        drafter.write_context(taps[None], positions, cache)
        block = torch.tensor([[anchor] + [drafter.config.mask_token_id] * (k - 1)])
        base = drafter.lm_head(drafter.block_hidden(block, length + torch.arange(k)[None], cache))[0]
        cache = drafter.new_cache(1, length + k, taps.dtype, taps.device)
        next_tokens = torch.tensor([PROMPT[1:] + [anchor]])
        chain = drafter.draft(next_tokens, taps[None], positions, torch.tensor([length - 1]), cache, k)
        biased = [next(chain)]
        for _ in range(k - 1):
            biased.append(chain.send(biased[-1].argmax(-1)))
    return base, torch.cat(biased)


def speculators_block(tmp_path, drafter_dir, taps, anchor: int) -> dict[str, torch.Tensor]:
    inputs, out = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    save_file({"taps": taps, "tokens": torch.tensor(PROMPT), "anchor": torch.tensor([anchor])}, str(inputs))
    run_speculators(TOOL, "step", str(drafter_dir), str(inputs), str(out))
    return load_file(str(out))


def test_one_block_matches_speculators(tmp_path, dspark_target, dspark_drafter):
    kind, drafter = runtime_drafter(dspark_target, dspark_drafter)
    aux = json.loads((dspark_drafter / "config.json").read_text())["aux_hidden_state_layer_ids"]
    assert kind.taps == tuple(aux)  # speculators' aux ids are vLLM's capture entries
    k = kind.default_speculative_tokens()  # the block size, as vLLM's default and speculators' forward
    taps, anchor = target_taps(dspark_target, kind.taps)
    expected = speculators_block(tmp_path, dspark_drafter, taps, anchor)
    base, biased = runtime_block(drafter, taps, anchor, k)
    torch.testing.assert_close(base, expected["base"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(biased, expected["logits"], rtol=1e-4, atol=1e-5)
    assert biased.argmax(-1).tolist() == expected["drafts"].tolist()
