"""Quantised weights held packed (runtime/models/packed.py): each rank holds the bytes the checkpoint stores for
them, the memory plan counts exactly that, and `check` gives the same findings and battery as with the weights
dequantised at load. Logits against the quantisation tools, on both paths: tests/oracles/test_quantized.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.kinds import drafter_kind
from specdoctor.runtime.memory import plan_memory
from specdoctor.runtime.models.packed import PackedLinear
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.partition import placements
from specdoctor.runtime.worker import build_rank
from tests.commands.test_check import specdoctor
from tests.helpers.reports import findings_of

MODES = ("packed", "dequantized")


def held_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def stored_bytes(checkpoint: Checkpoint, layers: range) -> int:
    """The oracle, from the headers alone: the layers' quantised weights at their stored parts' bytes, every
    other tensor at 4 bytes a value (the float32 compute dtype)."""
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    total = 0
    for key, info in checkpoint.tensors.items():
        if not key.startswith(prefixes):
            continue
        weight = checkpoint.quantized.get(key)
        parts = weight.parts.values() if weight else ()
        total += sum(checkpoint.stored[p].nbytes for p in parts) if weight else math.prod(info.shape) * 4
    return total


def test_each_rank_holds_its_quantised_weights_as_stored_and_the_plan_counts_them():
    checkpoint = Checkpoint("demo-w4a16")
    ranks = placements(checkpoint.config, 2, has_drafter=True)
    kind = drafter_kind(checkpoint, "demo-w4a16", None)
    plans = {mode: plan_memory(checkpoint, ranks, kind, RuntimeOptions("demo-w4a16", pp=2, quantized_weights=mode),
                               9, 64) for mode in MODES}  # fmt: skip
    for placement in ranks:
        options = RuntimeOptions("demo-w4a16", pp=2)
        model, _ = build_rank(options, placement.rank)
        held = held_bytes(model.stage) + (held_bytes(model.drafter) if model.drafter is not None else 0)
        assert held == plans["packed"].ranks[placement.rank].weights
        packed = [m for m in model.stage.modules() if isinstance(m, PackedLinear)]
        assert len(packed) == sum(key.startswith(f"model.layers.{i}.") for key in checkpoint.quantized
                                  for i in placement.layers)  # fmt: skip
        layers = held_bytes(model.stage.model.layers)
        assert layers == stored_bytes(checkpoint, placement.layers)
    first = ranks[0]
    saved = plans["dequantized"].ranks[0].weights - plans["packed"].ranks[0].weights
    assert saved > 2 * stored_bytes(checkpoint, first.layers)  # int4 words and bf16 scales against float32


@pytest.mark.slow
def test_check_gives_the_same_findings_and_battery_with_packed_or_dequantised_weights(tmp_path):
    """demo-w4a16 at PP 2, loaded as an unpatched engine does (unloaded memory zero-filled, so both runs start
    from the same bytes), repaired: the same report but for the memory each rank holds."""
    reports = {}
    for mode in MODES:
        result = specdoctor(
            "check", "--model", "demo-w4a16", "--pp", "2", "--drafter-policy", "engine-legacy", "--head-policy",
            "engine-legacy", "--fill", "zeros", "--repair", "--quantized-weights", mode, "--json", "-",
        )  # fmt: skip
        reports[mode] = json.loads(result.stdout)
        assert result.returncode == reports[mode]["verdict"]["exit_code"] == 0, result.stderr[-2000:]
    packed, dequantized = reports["packed"], reports["dequantized"]
    assert packed["settings"]["quantized_weights"] == "packed"
    assert findings_of(packed) == findings_of(dequantized)
    assert packed["stages"][0]["behaviour"]["battery"] == "9/9"
    assert packed["comparison"][0]["mean_acceptance_length"] < packed["comparison"][1]["mean_acceptance_length"]
    for p, d in zip(packed["memory"]["ranks"], dequantized["memory"]["ranks"], strict=True):
        assert p["weights"] < d["weights"]
