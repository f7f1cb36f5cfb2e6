"""Quantised weights: which scheme a checkpoint uses, which weights it covers, and how each one is read
back as a floating-point tensor (docs/quantization.md), from config.json and the headers alone.

The runtime dequantises three formats exactly: compressed-tensors `pack-quantized` (what llm-compressor
writes for W4A16), AutoAWQ GEMM and block-scaled FP8. Anything else that is quantised is refused with
the reason, never cast without its scales (a silently wrong model).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import torch

from specdoctor.kernels import reference

# Tensor-name endings that only quantised checkpoints have: FP8 scales, AutoAWQ, compressed-tensors.
QUANTISED_SUFFIXES = ("weight_scale_inv", "qweight", "qzeros", "weight_packed", "weight_scale", "weight_zero_point")
FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2")
PACKED_BITS = (4, 8)  # bit widths that fill an int32 word exactly
SCALE_STRATEGIES = ("group", "channel")


class QuantizedWeight(NamedTuple):
    """One linear weight stored quantised: its format and the checkpoint keys of its parts."""

    format: str  # "pack-quantized" | "awq" | "fp8-block"
    parts: dict[str, str]  # role -> key: packed/scale/zero_point/g_idx/shape, or weight/scale_inv
    shape: tuple[int, int]  # the dequantised [out, in] shape
    dtype: str  # safetensors dtype code the dequantised weight has (the scales')
    bits: int
    group_size: int  # columns per scale (pack-quantized, awq); 0 for fp8
    block: tuple[int, int] = (0, 0)  # fp8: rows x columns per scale


class Scan(NamedTuple):
    weights: dict[str, QuantizedWeight]  # the weight's own key (module + ".weight") -> how it is stored
    problems: list[str]  # why some quantised tensors cannot be dequantised (the runtime refuses then)


def quantization_scheme(raw_config: dict, tensors: dict) -> str | None:
    """One line naming the scheme, or None for floating-point weights."""
    config = raw_config.get("quantization_config")
    if isinstance(config, dict):
        return describe_config(config)
    float8 = sum(info.dtype in FLOAT8_DTYPES for info in tensors.values())
    marked = next((key for key in tensors if key.endswith(QUANTISED_SUFFIXES)), None)
    if float8 or marked:
        found = f"{float8} float8 tensor(s)" if float8 else f"tensors such as {marked}"
        return f"quantised weights without a quantization_config ({found})"
    return None


def describe_config(config: dict) -> str:
    method = str(config.get("quant_method", "unknown"))
    if method == "fp8":
        block = config.get("weight_block_size")
        return f"fp8 ({'block ' + 'x'.join(map(str, block)) if block else 'per-tensor'} scales)"
    if method == "awq":
        return (
            f"awq ({config.get('version', 'gemm')}, {config.get('bits', 4)}-bit, group {config.get('group_size', 128)})"
        )
    if method == "compressed-tensors":
        groups = config.get("config_groups")
        first = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        weights = first.get("weights") or {}
        details = [str(config.get("format", "unknown format"))]
        details += [f"{weights['num_bits']}-bit"] if weights.get("num_bits") else []
        details += [f"group {weights['group_size']}"] if weights.get("group_size") else []
        details += ["symmetric" if weights.get("symmetric", True) else "with zero points"]
        return f"compressed-tensors ({', '.join(details)})"
    return method


def scan(raw_config: dict, tensors: dict) -> Scan:
    """Every quantised weight the headers show, and what stops any of them from being dequantised."""
    config = raw_config.get("quantization_config")
    config = config if isinstance(config, dict) else {}
    weights: dict[str, QuantizedWeight] = {}
    problems: list[str] = []
    for key, info in tensors.items():
        module, _, role = key.rpartition(".")
        try:
            if role == "weight_packed":
                weights[f"{module}.weight"] = _pack_quantized(module, config, tensors)
            elif role == "qweight":
                weights[f"{module}.weight"] = _awq(module, config, tensors)
            elif role == "weight" and info.dtype in FLOAT8_DTYPES:
                weights[key] = _fp8_block(module, config, tensors)
        except ValueError as err:
            problems.append(f"{key}: {err}")
    covered = {key for weight in weights.values() for key in weight.parts.values()}
    stray = [key for key in tensors if key.endswith(QUANTISED_SUFFIXES) and key not in covered]
    problems += [f"{key}: a quantisation tensor of no weight the runtime dequantises" for key in stray[:1]]
    return Scan(weights, problems)


def _part(tensors: dict, module: str, role: str, required: bool = True) -> str | None:
    key = f"{module}.{role}"
    if key not in tensors and required:
        raise ValueError(f"{key} is missing (scales or zero points dropped?)")
    return key if key in tensors else None


def _pack_quantized(module: str, config: dict, tensors: dict) -> QuantizedWeight:
    if config.get("quant_method") != "compressed-tensors":
        raise ValueError("packed int32 weights without a compressed-tensors quantization_config")
    args = _compressed_tensors_weights(module, config)
    bits, strategy = args.get("num_bits"), args.get("strategy")
    if bits not in PACKED_BITS or args.get("type", "int") != "int" or strategy not in SCALE_STRATEGIES:
        raise ValueError(f"compressed-tensors {bits}-bit {args.get('type')} {strategy} weights are not run")
    parts = {
        "packed": _part(tensors, module, "weight_packed"),
        "scale": _part(tensors, module, "weight_scale"),
        "shape": _part(tensors, module, "weight_shape"),
    }
    zero_point = _part(tensors, module, "weight_zero_point", required=not args.get("symmetric", True))
    g_idx = _part(tensors, module, "weight_g_idx", required=False)
    parts |= {"zero_point": zero_point} if zero_point else {}
    parts |= {"g_idx": g_idx} if g_idx else {}
    rows, words = tensors[parts["packed"]].shape
    columns = words * 32 // bits  # exact for the multiple-of-8 widths models have; `read` checks weight_shape
    group = args.get("group_size") if strategy == "group" else columns
    return QuantizedWeight("pack-quantized", parts, (rows, columns), tensors[parts["scale"]].dtype, bits, group)


def _compressed_tensors_weights(module: str, config: dict) -> dict:
    """The weight arguments of the config group whose targets name this module (a class target such as
    `Linear` covers every linear layer the ignore list leaves)."""
    for group in (config.get("config_groups") or {}).values():
        targets = group.get("targets") or []
        if any(_matches(target, module) or target[:1].isupper() for target in targets):  # a class name: Linear
            if group.get("weights"):
                return group["weights"]
    raise ValueError("no config group of quantization_config covers it")


def _matches(pattern: str, module: str) -> bool:
    """compressed-tensors' module-name matching: `re:` patterns match from the start, others exactly."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def _awq(module: str, config: dict, tensors: dict) -> QuantizedWeight:
    if config.get("quant_method") != "awq" or str(config.get("version", "gemm")).lower() != "gemm":
        raise ValueError("AutoAWQ tensors are run in the GEMM packing only (quant_method awq, version gemm)")
    if config.get("bits", config.get("w_bit", 4)) != 4 or not config.get("zero_point", True):
        raise ValueError("AutoAWQ weights run at 4 bits with zero points only")
    parts = {role: _part(tensors, module, role) for role in ("qweight", "qzeros", "scales")}
    columns, words = tensors[parts["qweight"]].shape
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    return QuantizedWeight("awq", parts, (words * 8, columns), tensors[parts["scales"]].dtype, 4, group)


def _fp8_block(module: str, config: dict, tensors: dict) -> QuantizedWeight:
    block = config.get("weight_block_size")
    if config.get("quant_method") != "fp8" or not block:
        raise ValueError("float8 weights are run block-scaled only (quant_method fp8 with weight_block_size)")
    parts = {"weight": f"{module}.weight", "scale_inv": _part(tensors, module, "weight_scale_inv")}
    rows, columns = tensors[parts["weight"]].shape
    grid = tensors[parts["scale_inv"]].shape
    expected = (-(-rows // block[0]), -(-columns // block[1]))
    if tuple(grid) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(grid)}, {block[0]}x{block[1]} blocks need {expected}")
    dtype = tensors[parts["scale_inv"]].dtype
    return QuantizedWeight("fp8-block", parts, (rows, columns), dtype if dtype in ("F32", "BF16", "F16") else "F32",
                           8, 0, tuple(block))  # fmt: skip


def dequantize(weight: QuantizedWeight, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The [out, in] floating-point weight, its parts read with `read(key)` (exact: see kernels/reference.py)."""
    part = {role: read(key) for role, key in weight.parts.items()}
    if weight.format == "pack-quantized":
        if "shape" in part:  # a TP rank's slice has none (models/packed.py: sliced_parts)
            check_weight_shape(weight, part["shape"])
        return reference.dequantize_pack_quantized(
            part["packed"], part["scale"], part.get("zero_point"), weight.shape[1], weight.bits, weight.group_size,
            part.get("g_idx"),
        )  # fmt: skip
    if weight.format == "awq":
        return reference.dequantize_awq(part["qweight"], part["qzeros"], part["scales"], weight.group_size)
    return reference.dequantize_fp8_block(part["weight"], part["scale_inv"], weight.block, torch.float32)


def check_weight_shape(weight: QuantizedWeight, shape: torch.Tensor) -> None:
    """compressed-tensors' `weight_shape` against the shape the packed words hold; ValueError where they differ."""
    stored = tuple(shape.tolist())
    if stored != weight.shape:
        raise ValueError(f"weight_shape is {stored}, its packed words hold {weight.shape}; such widths are not run")


def ignored_by_config(config: dict, module: str) -> bool:
    """Whether quantization_config leaves `module` unquantised (its ignore / modules_to_not_convert list)."""
    if config.get("quant_method") == "compressed-tensors":
        return any(_matches(pattern, module) for pattern in config.get("ignore") or [])
    skipped = config.get("modules_to_not_convert") or config.get("ignored_layers") or []
    return any(name in module for name in skipped)  # transformers' and vLLM's substring rule
