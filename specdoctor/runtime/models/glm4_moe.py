"""The GLM-4.5 MoE family (`Glm4MoeForCausalLM`): its config mapping, decoder block and MTP layer.

Grouped-query attention with partial rotary embedding, optional q/k norm and attention bias;
`first_k_dense_replace` dense layers, then MoE layers (sigmoid group-limited router with a
score-correction bias, plus shared experts). vLLM 0.32: `models/glm4_moe.py` (target) and
`models/glm4_moe_mtp.py` (drafter); its embedding sits on the first rank only, tied or not.
"""

from __future__ import annotations

import torch
from torch import nn

from specdoctor.runtime.config import ModelConfig, MtpKeyLayout, RawConfig
from specdoctor.runtime.kv_cache import KVCache
from specdoctor.runtime.models.layers import MLP, Attention, MoE, RMSNorm, SharedHead

ARCHITECTURE = "Glm4MoeForCausalLM"


def read_config(raw: RawConfig, architecture: str, layout: MtpKeyLayout) -> ModelConfig:
    hidden = raw.need("hidden_size")
    heads = raw.need("num_attention_heads")
    head_dim = int(raw.get("head_dim") or hidden // heads)
    # Older GLM configs keep rope settings at the top level; newer ones under rope_parameters.
    rope = raw.get("rope_parameters") or {}
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.5)))
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw.need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=raw.need("intermediate_size"),
        num_hidden_layers=raw.need("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        attention_bias=bool(raw.get("attention_bias", False)),
        use_qk_norm=bool(raw.get("use_qk_norm", False)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
        n_routed_experts=int(raw.get("n_routed_experts") or 0),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 1)),
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        num_nextn_predict_layers=raw.mtp_layer_count(layout),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        eos_token_ids=raw.eos_token_ids(),
        mtp_keys=layout,
    )


class DecoderLayer(nn.Module):
    """Attention then a dense MLP or (from `first_k_dense_replace`) MoE, each pre-normed with a residual."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        if config.is_moe_layer(layer_id):
            self.mlp = MoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T]
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None,
    ) -> torch.Tensor:  # [B, T, H]
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class MtpLayer(DecoderLayer):
    """A full decoder block plus the MTP input projection and its own output head."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)
