"""One EAGLE-3 draft step against speculators' own Eagle3DraftModel (its forward pass on heads it wrote):
the runtime's head, built by its drafter kind beside the target as the engine builds it, gives the same
logits for the same aux states, tokens and positions, with the states taken from transformers' Llama.
The three heads cover both checkpoint layouts, a pruned vocabulary with d2t, norm_before_fc and
norm_before_residual both ways, aux ids listed out of layer order, the engine's default ids, and the target's
embedding and head shared. The aux states are chosen from each head's config as vLLM reads it, not by the
runtime's own kind."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.eagle3 import TARGET_LAYERS, run_tool

pytestmark = pytest.mark.tool_env("speculators")  # installed before the tests start (tests/conftest.py)

PROMPT = [3, 17, 101, 45, 9, 250, 77, 12, 5, 199, 64, 31]


def target_aux(target, entries: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' residual stream entering each layer in `entries` [T, aux, H], and the prompt's next tokens
    (the prompt shifted left, the target's greedy token last): what the engine feeds the first step."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(target).eval()
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), output_hidden_states=True)
    aux = torch.stack([out.hidden_states[entry][0] for entry in entries], dim=1)
    return aux, torch.tensor(PROMPT[1:] + [int(out.logits[0, -1].argmax())])


def runtime_head(target, head, **options):
    from specdoctor.runtime.checkpoint.loader import load_full_target
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import open_drafter
    from specdoctor.runtime.options import RuntimeOptions

    checkpoint = Checkpoint(target)
    runtime = RuntimeOptions(str(target), speculative_model=str(head), **options)
    kind = open_drafter(checkpoint, runtime)
    drafter, _ = kind.build(load_full_target(checkpoint), runtime, torch.device("cpu"))
    return kind, drafter


def speculators_step(tmp_path, head, aux, tokens, verifier=None) -> torch.Tensor:
    """speculators' draft-vocabulary logits [T, draft_vocab] of one step at positions 0..T-1."""
    save_file({"aux": aux, "tokens": tokens, "positions": torch.arange(len(tokens))}, str(tmp_path / "in.safetensors"))
    extra = ["--verifier", str(verifier)] if verifier else []
    run_tool("step", str(head), str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"), *extra)
    return load_file(str(tmp_path / "out.safetensors"))["logits"]


def draft_ids_in_target(head, kind) -> torch.Tensor:
    """Each draft id's target id: its d2t offset added, or the id itself over the whole vocabulary."""
    config = kind.drafter.config
    if not config.reduced_vocab:
        return torch.arange(config.vocab_size)
    return torch.arange(config.draft_vocab_size) + load_file(str(head / "model.safetensors"))["d2t"]


def vllm_aux_entries(head) -> tuple[int, ...]:
    """What vLLM 0.32 captures for a head, from its config alone: the listed ids in layer order (its capture
    loop), or its default (2, L // 2, L - 3)."""
    ids = json.loads((head / "config.json").read_text()).get("eagle_aux_hidden_state_layer_ids")
    return tuple(sorted(set(ids))) if ids else (2, TARGET_LAYERS // 2, TARGET_LAYERS - 3)


def runtime_step(drafter, aux, tokens) -> torch.Tensor:
    with torch.no_grad():
        _, logits = drafter(tokens[None], drafter.combine(aux[None]), torch.arange(len(tokens))[None])
    return logits[0]


@pytest.mark.parametrize("head_fixture", ["pruned_head", "shared_head", "original_head", "qwen3_head"])
def test_one_draft_step_matches_speculators(request, tmp_path, eagle3_target, head_fixture):
    head = request.getfixturevalue(head_fixture)
    kind, drafter = runtime_head(eagle3_target, head)
    assert kind.taps == vllm_aux_entries(head)
    aux, tokens = target_aux(eagle3_target, vllm_aux_entries(head))
    original = head_fixture == "original_head"
    expected = speculators_step(tmp_path, head, aux, tokens, verifier=eagle3_target if original else None)
    logits, target_ids = runtime_step(drafter, aux, tokens), draft_ids_in_target(head, kind)
    torch.testing.assert_close(logits[:, target_ids], expected, rtol=1e-4, atol=1e-5)
    elsewhere = torch.ones(logits.shape[-1], dtype=torch.bool)
    elsewhere[target_ids] = False
    assert bool((logits[:, elsewhere] == float("-inf")).all())  # vLLM's compute_logits: no other id is drafted
    assert logits.argmax(-1).tolist() == target_ids[expected.argmax(-1)].tolist()


def test_the_stage_captures_the_aux_states_transformers_computes(eagle3_target, pruned_head):
    """The entries the target's stage captures for the head are transformers' hidden_states at those ids."""
    from specdoctor.runtime.checkpoint.loader import load_full_target
    from specdoctor.runtime.checkpoint.reader import Checkpoint

    kind, _ = runtime_head(eagle3_target, pruned_head)
    stage = load_full_target(Checkpoint(eagle3_target))
    stage.tap_entries = kind.taps
    with torch.no_grad():
        _, taps = stage.forward_with_taps(torch.tensor([PROMPT]), torch.arange(len(PROMPT))[None], None)
    expected, _ = target_aux(eagle3_target, kind.taps)
    for slot, entry in enumerate(kind.taps):
        torch.testing.assert_close(taps[entry][0], expected[:, slot], rtol=1e-5, atol=1e-5)
