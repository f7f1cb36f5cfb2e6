"""The GLM-4.5 MoE family (`Glm4MoeForCausalLM`): its config mapping, decoder block and MTP layer.

Grouped-query attention with partial rotary embedding, optional q/k norm and attention bias;
`first_k_dense_replace` dense layers, then MoE layers (sigmoid group-limited router with a
score-correction bias, plus shared experts). vLLM 0.32: `models/glm4_moe.py` (target) and
`models/glm4_moe_mtp.py` (drafter); its embedding sits on the first rank only, tied or not.
"""

from __future__ import annotations

from specdoctor.runtime.config import ModelConfig, MtpKeyLayout, RawConfig, common_fields
from specdoctor.runtime.models.attention import Attention
from specdoctor.runtime.models.blocks import DecoderBlock, DeepseekMtpLayer

ARCHITECTURE = "Glm4MoeForCausalLM"


def read_config(raw: RawConfig, architecture: str, layout: MtpKeyLayout) -> ModelConfig:
    hidden = raw.need("hidden_size")
    heads = raw.need("num_attention_heads")
    head_dim = int(raw.get("head_dim") or hidden // heads)
    # Older GLM configs keep rope settings at the top level; newer ones under rope_parameters.
    rope = raw.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5)))
    return ModelConfig(
        **common_fields(raw, architecture, layout),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        use_qk_norm=bool(raw.get("use_qk_norm", False)),
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
    )


class DecoderLayer(DecoderBlock):
    """GLM-4.5's block: grouped-query attention with partial rotary, then a dense MLP or MoE."""

    attention = Attention


class MtpLayer(DeepseekMtpLayer, DecoderLayer):
    """GLM-4.5's MTP layer: its decoder block plus the MTP input projection and its own output head."""
