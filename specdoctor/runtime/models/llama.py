"""Llama (`LlamaForCausalLM`): the target most EAGLE-3 heads and draft models are trained for.

Grouped-query attention without q/k norm, rotary over the whole head (neox layout), optionally Llama-3's
rope scaling, a dense SwiGLU MLP in every layer: GLM-4.5's block with those settings. The checkpoint has no
MTP layers: without a separate drafter it decodes plainly. vLLM 0.32: `models/llama.py`.
"""

from __future__ import annotations

from specdoctor.errors import CheckpointError
from specdoctor.runtime.config import (
    Llama3Scaling,
    ModelConfig,
    MtpKeyLayout,
    RawConfig,
    common_fields,
    dense_attention_fields,
)
from specdoctor.runtime.models import glm4_moe
from specdoctor.runtime.models.attention import Attention

ARCHITECTURE = "LlamaForCausalLM"


class LlamaAttention(Attention):
    output_bias = True  # Llama's attention_bias covers o_proj too (transformers' and vLLM's LlamaAttention)


class DecoderLayer(glm4_moe.DecoderLayer):
    """GLM-4.5's block without q/k norm, with full rotary and no MoE layer, and Llama's attention biases."""

    attention = LlamaAttention


def read_rope_scaling(raw: RawConfig) -> tuple[float, Llama3Scaling | None]:
    """(rope_theta, Llama-3 scaling or None) from `rope_parameters` (transformers 5) or `rope_scaling`."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{raw.source}: rope_scaling must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise CheckpointError(f"{raw.source}: rope_type {kind!r} is not supported for Llama (default, llama3)")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    try:
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        if kind == "default":
            return theta, None
        values = [float(rope[name]) for name in fields]
    except KeyError as missing:
        raise CheckpointError(f"{raw.source}: llama3 rope scaling without {missing.args[0]}") from None
    except (TypeError, ValueError):
        raise CheckpointError(
            f"{raw.source}: llama3 rope scaling needs numbers for rope_theta and {', '.join(fields)}"
        ) from None
    if min(values) <= 0:
        raise CheckpointError(f"{raw.source}: llama3 rope scaling needs positive {', '.join(fields)}, got {values}")
    return theta, Llama3Scaling(values[0], values[1], values[2], int(values[3]))


def read_config(raw: RawConfig, architecture: str, layout: MtpKeyLayout) -> ModelConfig:
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{raw.source}: mlp_bias is set; the runtime's MLP has no bias")
    theta, scaling = read_rope_scaling(raw)
    return ModelConfig(
        **common_fields(raw, architecture, layout),
        **dense_attention_fields(raw),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        use_qk_norm=False,
        first_k_dense_replace=raw.need("num_hidden_layers"),  # every layer dense
    )
