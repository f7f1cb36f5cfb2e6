"""Rotary position embeddings: plain, YaRN-scaled as DeepSeek-V3 configures them or Llama-3-scaled, applied
in the neox layout (halves) or DeepSeek's interleaved layout (pairs)."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from specdoctor.runtime.config import Llama3Scaling, ModelConfig, RopeScaling, YarnScaling

# Draft chains may run up to 2k (k <= 8) positions past the context; the tables cover them.
POSITION_SLACK = 32


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], the factor cos and sin are scaled by), as vLLM computes them for each
    scaling (docs/engine-semantics.md §MLA and DSA for YaRN); plain RoPE without `scaling`."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    if isinstance(scaling, Llama3Scaling):
        return llama3_frequencies(1.0 / pos_freqs, scaling), 1.0
    return yarn_frequencies(dim, theta, pos_freqs, scaling)


def llama3_frequencies(inv_freq: torch.Tensor, scaling: Llama3Scaling) -> torch.Tensor:
    original = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (original / wavelength - low) / (high - low) if low != high else torch.zeros_like(inv_freq)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / scaling.factor, blended)
    return torch.where(wavelength < original / high, inv_freq, scaled)


def yarn_frequencies(dim: int, theta: float, pos_freqs: torch.Tensor, yarn: YarnScaling) -> tuple[torch.Tensor, float]:
    # An unset mscale counts as 0 (a factor of 1), as in vLLM; transformers differs when only one is set.
    attention_factor = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    low, high = max(math.floor(low), 0), min(math.ceil(high), dim - 1)
    ramp = (
        (torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low)
    ).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency; 0: interpolate it by the factor
    inv_freq = (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


@functools.lru_cache(maxsize=8)
def rotary_table(
    dim: int,
    theta: float,
    scaling: RopeScaling | None,
    length: int,
    device: torch.device,
    dtype: torch.dtype,
    wrap: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position up to `length`, [length, dim] each: computed once, then indexed
    (building them per forward costs more than the attention itself on a small model). `wrap`: the config's
    rope_wrap."""
    inv_freq, scale = inverse_frequencies(dim, theta, scaling)
    positions = torch.arange(length, device=device)
    if wrap:
        positions = positions % wrap
    freqs = positions.float()[:, None] * inv_freq.to(device)
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def rotary_cos_sin(
    config: ModelConfig,
    positions: torch.Tensor,  # [B, T]
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for the rotary part of each head, [B, T, rotary_dim] each."""
    cos, sin = rotary_tables(config, positions.device, dtype)
    return cos[positions], sin[positions]


def rotary_tables(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's cos and sin for every position it can reach, [positions, rotary_dim] each."""
    length = config.max_position_embeddings + POSITION_SLACK
    return rotary_table(
        config.rotary_dim, config.rope_theta, config.rope_scaling, length, device, dtype, config.rope_wrap
    )


def wrap_rope_past(drafter: torch.nn.Module, past: int) -> None:
    """--fault drafter-rope-past=N: the drafter's positions from N on rotate as their remainder by N, as a drafter
    run past its trained range without the target's RoPE scaling sees positions it never learned: its attention
    over its own earlier entries goes wrong with distance, a partial fall rather than dummy drafts."""
    for module in drafter.modules():
        config = getattr(module, "config", None)
        if isinstance(config, ModelConfig):
            module.config = dataclasses.replace(config, rope_wrap=past)
        elif isinstance(getattr(config, "backbone", None), ModelConfig):  # a DSpark or EAGLE-3 config
            module.config = dataclasses.replace(config, backbone=dataclasses.replace(config.backbone, rope_wrap=past))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of each head, neox layout; x: [B, T, heads, D], cos/sin: [B, T, R]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = rot // 2
    rotated_half = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated_half * sin, x_pass), dim=-1)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: features (2i, 2i+1) rotate together by frequency i; the result comes out with the
    even features first, then the odd ones (as transformers computes it: only dot products matter).
    x: [B, T, heads, R], cos/sin: [B, T, R] (each frequency twice, as the table holds them)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, :, None, :half], sin[:, :, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
