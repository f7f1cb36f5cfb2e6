"""The dense Qwen3 family (`Qwen3ForCausalLM`): the target DSpark and DFlash drafters are trained for.

Grouped-query attention with per-head q/k RMSNorm and rotary over the whole head (neox layout), no
attention bias by default, a dense SwiGLU MLP in every layer; the block is GLM-4.5's with those settings.
The checkpoint has no MTP layers: its drafters are separate checkpoints (a DSpark drafter: docs/dspark.md,
runtime/drafter/dspark.py); without one it decodes plainly. vLLM 0.32: `models/qwen3.py`.
"""

from __future__ import annotations

from specdoctor.errors import CheckpointError
from specdoctor.runtime.config import ModelConfig, MtpKeyLayout, RawConfig, common_fields, dense_attention_fields
from specdoctor.runtime.models import glm4_moe

ARCHITECTURE = "Qwen3ForCausalLM"
DecoderLayer = glm4_moe.DecoderLayer  # with use_qk_norm, full rotary and no MoE layer, GLM-4.5's block is Qwen3's


def read_config(raw: RawConfig, architecture: str, layout: MtpKeyLayout) -> ModelConfig:
    if raw.get("attention_bias"):  # transformers' Qwen3 then biases o_proj too, vLLM's does not
        raise CheckpointError(
            f"{raw.source}: attention_bias is set; vLLM and transformers bias Qwen3's o_proj differently"
        )
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{raw.source}: use_sliding_window is set; the runtime runs full attention only")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(
            f"{raw.source}: rope_type {rope['rope_type']!r} is not supported for Qwen3 (default only)"
        )
    layers = raw.need("num_hidden_layers")
    return ModelConfig(
        **common_fields(raw, architecture, layout),
        **dense_attention_fields(raw),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 1000000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        use_qk_norm=True,
        first_k_dense_replace=layers,  # every layer dense
    )
