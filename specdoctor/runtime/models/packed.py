"""Linear layers whose weight stays as the checkpoint stores it: packed int4/int8 words or float8 with block
scales, multiplied through the quantised GEMMs (kernels.w4a16_matmul, kernels.fp8_block_matmul) instead of
being dequantised at load (docs/quantization.md §Memory)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor import kernels
from specdoctor.runtime.quantization import QuantizedWeight, check_weight_shape, dequantize


class PackedLinear(nn.Module):
    """nn.Linear's forward over a quantised weight held packed. Its buffers carry the checkpoint's own names
    for the parts (`weight_packed`, `weight_scale`, `qweight`, `weight_scale_inv`, ...), so the loader maps
    them to keys as it maps any tensor, and they keep the stored dtypes whatever the compute dtype."""

    def __init__(self, weight: QuantizedWeight, parts: dict[str, tuple[tuple[int, ...], torch.dtype]], bias: bool):
        super().__init__()
        self.spec = weight
        self.out_features, self.in_features = weight.shape
        self.roles = {}  # role (quantization.QuantizedWeight.parts) -> buffer name
        for role, key in weight.parts.items():
            name = key.rpartition(".")[2]
            shape, dtype = parts[key]
            self.register_buffer(name, torch.empty(shape, dtype=dtype))
            self.roles[role] = name
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    def _apply(self, fn, recurse=True):
        # A move (`.to(device)`, `to_empty`) moves the parts; a cast to the compute dtype would unpack the
        # float8 weight to 4 bytes an element and round fp32 scales, so the parts keep their dtypes.
        parts = dict(self._buffers)
        self._buffers.clear()
        super()._apply(fn, recurse)
        for name, part in parts.items():
            if part.is_meta:  # no values to round: `fn` as for any tensor (to_empty allocates), its dtype undone
                self._buffers[name] = fn(part).to(part.dtype)
            else:
                self._buffers[name] = part.to(fn(torch.empty(0, dtype=part.dtype, device=part.device)).device)
        return self

    def part(self, role: str) -> torch.Tensor | None:
        return self._buffers[self.roles[role]] if role in self.roles else None

    def check_shape(self) -> None:
        """A compressed-tensors weight's `weight_shape` against its packed words (the 4-bit GEMMs never read it)."""
        if self.part("shape") is not None:
            check_weight_shape(self.spec, self.part("shape"))

    def dequantized(self) -> torch.Tensor:
        """The [out, in] weight in the dtype dequantising at load gives it."""
        return dequantize(self.spec, lambda key: self._buffers[key.rpartition(".")[2]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        out = self.matmul(x)
        return out + self.bias if self.bias is not None else out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x times the weight, without the bias (a row-parallel rank adds it once: models/parallel_layers.py)."""
        flat = x.reshape(-1, self.in_features)
        spec, part = self.spec, self.part
        if spec.format == "fp8-block":
            scale_inv = part("scale_inv")  # ue8m0 powers of two, a type kernels do not load: as fp32 (exact)
            scale_inv = scale_inv.float() if scale_inv.dtype == torch.float8_e8m0fnu else scale_inv
            out = kernels.fp8_block_matmul(flat, part("weight"), scale_inv, spec.block)
        elif spec.format == "awq":
            out = kernels.w4a16_matmul(flat, part("qweight"), part("scales"), part("qzeros"), spec.group_size, "awq")
        elif spec.bits == 4 and part("g_idx") is None:
            out = kernels.w4a16_matmul(
                flat, part("packed"), part("scale"), part("zero_point"), spec.group_size, "pack-quantized"
            )
        else:  # 8-bit words and activation-ordered groups have no GEMM of their own: dequantise per call
            out = F.linear(flat, self.dequantized().to(x.dtype))
        return out.view(*x.shape[:-1], self.out_features)


# Per format, each part's (output axis, input axis) of the weight: the axes a TP rank's slice of the weight cuts
# (packed words and scale groups scale with them; None: the part has no such axis).
PART_AXES = {
    "pack-quantized": {"packed": (0, 1), "scale": (0, 1), "zero_point": (0, 1), "g_idx": (None, 0)},
    "awq": {"qweight": (1, 0), "qzeros": (1, 0), "scales": (1, 0)},
    "fp8-block": {"weight": (0, 1), "scale_inv": (0, 1)},
}


def slice_units(weight: QuantizedWeight) -> tuple[int, int]:
    """The weight rows and columns a slice must hold whole multiples of: the values one packed word holds along
    the axis it packs, a scale group, a scale block (vLLM's kernels refuse any other slice)."""
    per_word = 32 // weight.bits
    if weight.format == "fp8-block":
        return weight.block
    if weight.format == "awq":
        return per_word, weight.group_size  # words pack the output axis
    zero_points = "zero_point" in weight.parts  # packed along the output axis too
    return (per_word if zero_points else 1), math.lcm(per_word, weight.group_size)


def sliced_parts(
    weight: QuantizedWeight, parts: dict[str, tuple[tuple[int, ...], torch.dtype]], local: tuple[int, int]
) -> tuple[QuantizedWeight, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """The weight of one TP rank's [out, in] slice `local` of it, and its parts' shapes: each part's output and
    input axes cut in proportion (ValueError where words, groups or blocks do not divide so, as vLLM refuses).
    compressed-tensors' `weight_shape`, the whole weight's, is left out (checked against the whole at load)."""
    for axis, (whole, part, unit) in enumerate(zip(weight.shape, local, slice_units(weight), strict=True)):
        if part != whole and part % unit:
            name = ("output", "input")[axis]
            raise ValueError(
                f"a rank's {part} {name} values of {whole} are not whole multiples of {unit} (packed words, scale "
                "groups or blocks); vLLM refuses such a slice too"
            )
    ratios = (local[0] / weight.shape[0], local[1] / weight.shape[1])
    sliced = {}
    for role, key in weight.parts.items():
        if role == "shape":
            continue
        shape, dtype = parts[key]
        axes = PART_AXES[weight.format][role]
        new = list(shape)
        for axis, ratio in zip(axes, ratios, strict=True):
            if axis is not None and ratio != 1:
                if (shape[axis] * ratio) % 1:
                    raise ValueError(f"{key}'s {shape[axis]} along axis {axis} do not split into a {local} slice")
                new[axis] = int(shape[axis] * ratio)
        sliced[key] = (tuple(new), dtype)
    kept = {role: key for role, key in weight.parts.items() if role != "shape"}
    return weight._replace(parts=kept, shape=local), sliced


def any_packed(*modules: nn.Module) -> bool:
    """Whether any of the linears holds its weight packed (then it cannot share a fused weight)."""
    return any(isinstance(module, PackedLinear) for module in modules)
