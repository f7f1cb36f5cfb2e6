"""Which quantisation scheme a checkpoint's weights use, from config.json and the headers alone.

The runtime computes with floating-point weights only; it refuses a quantised checkpoint rather than
cast packed integers or FP8 values without their scales (a silently wrong model).
"""

from __future__ import annotations

# Tensor-name endings that only quantised checkpoints have: FP8 block scales, AutoAWQ, compressed-tensors.
QUANTISED_SUFFIXES = ("weight_scale_inv", "qweight", "qzeros", "weight_packed", "weight_scale", "weight_zero_point")
FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2")


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
        return f"compressed-tensors ({', '.join(details)})"
    return method
