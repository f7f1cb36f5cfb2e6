"""Quantised weights held packed (runtime/models/packed.py): each rank holds the bytes the checkpoint stores for
them, the memory plan counts exactly that, and `check` gives the same findings and battery as with the weights
dequantised at load. Logits against the quantisation tools, on both paths: tests/oracles/test_quantized.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.registry import drafter_kind
from specdoctor.runtime.memory import plan_memory
from specdoctor.runtime.models.packed import PackedLinear
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.partition import placements
from specdoctor.runtime.quantization import QuantizedWeight, dequantize
from specdoctor.runtime.rank_loading import build_rank
from tests.commands.test_check import specdoctor
from tests.helpers.reports import findings_of
from tests.kernels.test_kernels import random_words

MODES = ("packed", "dequantized")


def held_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def layer_prefixes(layers: range) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}." for i in layers)


def stored_bytes(checkpoint: Checkpoint, layers: range) -> int:
    """The oracle, from the headers alone: the layers' quantised weights at their stored parts' bytes, every
    other tensor at 4 bytes a value (the float32 compute dtype)."""
    total = 0
    for key, info in checkpoint.tensors.items():
        if not key.startswith(layer_prefixes(layers)):
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
    for mode in MODES:
        for placement in ranks:
            model, _ = build_rank(RuntimeOptions("demo-w4a16", pp=2, quantized_weights=mode), placement.rank)
            held = held_bytes(model.stage) + (held_bytes(model.drafter) if model.drafter is not None else 0)
            assert held == plans[mode].ranks[placement.rank].weights, mode
            packed = [m for m in model.stage.modules() if isinstance(m, PackedLinear)]
            owned = [key for key in checkpoint.quantized if key.startswith(layer_prefixes(placement.layers))]
            assert len(packed) == (len(owned) if mode == "packed" else 0)
            if mode == "packed":
                assert held_bytes(model.stage.model.layers) == stored_bytes(checkpoint, placement.layers)
    first = ranks[0]
    saved = plans["dequantized"].ranks[0].weights - plans["packed"].ranks[0].weights
    assert saved > 2 * stored_bytes(checkpoint, first.layers)  # int4 words and bf16 scales against float32


@pytest.mark.slow
def test_check_gives_the_same_findings_and_battery_with_packed_or_dequantised_weights():
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


def packed_linear(weight: QuantizedWeight, parts: dict[str, torch.Tensor]) -> PackedLinear:
    linear = PackedLinear(weight, {key: (tuple(t.shape), t.dtype) for key, t in parts.items()}, bias=False)
    for key, tensor in parts.items():
        linear.get_buffer(key.rpartition(".")[2]).copy_(tensor)
    return linear


@pytest.mark.parametrize("case", ["8-bit", "activation-order", "fp8-ue8m0"])
def test_weights_without_a_kernel_of_their_own_compute_their_dequantised_product(case):
    """8-bit words and activation-ordered groups are dequantised per call, block FP8 with ue8m0 (power-of-two)
    scales goes through its GEMM: each layer gives x times its weight dequantised as loading would (the formats'
    references, which tests/oracles/test_quantized.py holds to the tools)."""
    generator = torch.Generator().manual_seed(3)
    rows, columns, x = 16, 64, torch.randn(5, 64, generator=generator)
    module = "model.layers.0.mlp.up_proj"
    if case == "fp8-ue8m0":
        codes = torch.randint(0, 126, (rows, columns), generator=generator, dtype=torch.uint8)  # no NaN codes
        exponents = torch.randint(120, 134, (2, 2), generator=generator, dtype=torch.uint8)
        parts = {f"{module}.weight": codes.view(torch.float8_e4m3fn),
                 f"{module}.weight_scale_inv": exponents.view(torch.float8_e8m0fnu)}  # fmt: skip
        roles = {"weight": f"{module}.weight", "scale_inv": f"{module}.weight_scale_inv"}
        weight = QuantizedWeight("fp8-block", roles, (rows, columns), "F32", 8, 0, (8, 32))
    else:
        bits, group = (8, columns) if case == "8-bit" else (4, 16)
        parts = {
            f"{module}.weight_packed": random_words((rows, columns * bits // 32), generator),
            f"{module}.weight_scale": torch.rand(rows, columns // group, generator=generator).to(torch.bfloat16),
            f"{module}.weight_shape": torch.tensor([rows, columns], dtype=torch.int32),
        }
        if case == "activation-order":
            parts[f"{module}.weight_g_idx"] = torch.randperm(columns, generator=generator).int() // group
        role_of = {"weight_packed": "packed", "weight_scale": "scale", "weight_shape": "shape", "weight_g_idx": "g_idx"}
        roles = {role_of[key.rpartition(".")[2]]: key for key in parts}
        weight = QuantizedWeight("pack-quantized", roles, (rows, columns), "BF16", bits, group)
    linear = packed_linear(weight, parts)
    expected = dequantize(weight, parts.__getitem__).to(x.dtype)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, expected), rtol=1e-5, atol=1e-5)


def test_a_weight_shape_its_words_do_not_hold_is_refused():
    generator = torch.Generator().manual_seed(4)
    module = "model.layers.0.mlp.up_proj"
    parts = {
        f"{module}.weight_packed": random_words((16, 8), generator),
        f"{module}.weight_scale": torch.ones(16, 4, dtype=torch.bfloat16),
        f"{module}.weight_shape": torch.tensor([16, 60], dtype=torch.int32),
    }
    roles = dict(zip(("packed", "scale", "shape"), parts, strict=True))
    linear = packed_linear(QuantizedWeight("pack-quantized", roles, (16, 64), "BF16", 4, 16), parts)
    with pytest.raises(ValueError, match=r"weight_shape is \(16, 60\), its packed words hold \(16, 64\)"):
        linear.check_shape()


def test_the_drafters_rank_alone_maps_packed_parts_as_stored():
    """demo-w4a16 in less memory than its ranks need: the drafter's rank is built alone, lazily, its packed parts
    copy-on-write maps of the shards in their stored dtypes; the drafter is measured and repaired there."""
    result = specdoctor(
        "check", "--model", "demo-w4a16", "--pp", "2", "--memory-limit", "200MiB", "--drafter-policy",
        "engine-legacy", "--fill", "zeros", "--repair", "--json", "-",
    )  # fmt: skip
    report = json.loads(result.stdout)
    assert result.returncode == report["verdict"]["exit_code"] == 1, result.stderr[-2000:]
    assert report["verdict"]["summary"].startswith("not verified") and report["memory"]["fits"] is False
    assert report["repair"]["repaired"] == {"embed_tokens.weight": "model.embed_tokens.weight"}
    before, after = report["stages"]
    assert "drafter.fingerprint" in {f["check"] for f in before["findings"] if f["severity"] == "error"}
    assert [f["check"] for f in after["findings"] if f["severity"] == "error"] == ["runtime.skipped"]
