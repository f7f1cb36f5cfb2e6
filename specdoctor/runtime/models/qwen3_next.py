"""The Qwen3-Next / Qwen3.5 hybrid family: `Qwen3NextForCausalLM`, `Qwen3_5MoeForCausalLM` and the dense
`Qwen3_5ForCausalLM` (text models), and the multimodal Qwen3.5 releases' text model: config mapping, gated
attention, the MoE and the `mtp.*` drafter layer.

Layers follow `layer_types` (or every `full_attention_interval`-th layer full attention): Gated DeltaNet
linear attention (models/gated_deltanet.py), or gated full attention (q_proj yields each head's query
and a sigmoid output gate; q/k RMSNorm; partial rotary, neox layout). Norms scale by (1 + weight). The
MoE routes by softmax top-k and adds a shared expert scaled by sigmoid(shared_expert_gate(x)). The MTP
drafter (vLLM 0.32: `qwen3_next_mtp.py`, `qwen3_5_mtp.py`) is one full-attention decoder layer behind
`fc(cat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)))`, normed by `mtp.norm`, with the
target's embedding and head; its normed output feeds the next chain step
(docs/engine-semantics.md §Hybrid models).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor import kernels
from specdoctor.errors import CheckpointError
from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.config import ModelConfig, MtpKeyLayout, RawConfig, common_fields
from specdoctor.runtime.models.attention import attention_span
from specdoctor.runtime.models.blocks import DecoderBlock
from specdoctor.runtime.models.gated_deltanet import GatedDeltaNet
from specdoctor.runtime.models.layers import MLP, RMSNorm
from specdoctor.runtime.models.moe import MoE
from specdoctor.runtime.models.parallel_layers import ParallelLMHead, row_parallel
from specdoctor.runtime.models.rope import apply_rotary

FUSED_PROJECTION = {"Qwen3NextForCausalLM": True, "Qwen3_5ForCausalLM": False, "Qwen3_5MoeForCausalLM": False}
ARCHITECTURES = tuple(FUSED_PROJECTION)
# The multimodal releases (vLLM: qwen3_5.py) nest this text model's config under `text_config` and its weights under
# `model.language_model.` (registry.read_config reads both there); the vision tower is not read.
TEXT_ARCHITECTURE = {
    "Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3_5MoeForCausalLM",
}
MULTIMODAL_ARCHITECTURES = tuple(TEXT_ARCHITECTURE)
# Every layer MoE, no dense MLP: transformers' Qwen3_5MoeTextConfig has no `intermediate_size` (vLLM builds the
# sparse block in every layer of a `qwen3_5_moe_text` model).
ALL_MOE = "Qwen3_5MoeForCausalLM"
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridConfig(ModelConfig):
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    fused_qkvz: bool = False  # Qwen3-Next's grouped in_proj_qkvz / in_proj_ba
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_linear_attention(self, layer_id: int) -> bool:
        return layer_id < len(self.layer_types) and self.layer_types[layer_id] == "linear_attention"

    def is_moe_layer(self, layer_id: int) -> bool:
        sparse = (layer_id + 1) % self.decoder_sparse_step == 0
        return self.n_routed_experts > 0 and layer_id not in self.mlp_only_layers and sparse

    @property
    def linear_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv window (channels, kernel - 1), delta-rule state (value heads, key dim, value dim))."""
        channels = 2 * self.linear_num_key_heads * self.linear_key_head_dim
        channels += self.linear_num_value_heads * self.linear_value_head_dim
        state = (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)
        return (channels, self.linear_conv_kernel_dim - 1), state


def read_layer_types(raw: RawConfig) -> tuple[str, ...]:
    layers = raw.need("num_hidden_layers")
    types = raw.get("layer_types")
    if not types:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != layers:
        raise CheckpointError(f"{raw.source}: layer_types must name {layers} layers from {LAYER_TYPES}, got {types}")
    return tuple(types)


def read_config(raw: RawConfig, architecture: str, layout: MtpKeyLayout) -> HybridConfig:
    hidden, heads = raw.need("hidden_size"), raw.need("num_attention_heads")
    head_dim = int(raw.get("head_dim") or hidden // heads)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(f"{raw.source}: rope {rope} is not supported (default rope)")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{raw.source}: hidden_act {raw.get('hidden_act')!r} is not supported (silu)")
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    text = TEXT_ARCHITECTURE.get(architecture, architecture)
    all_moe = text == ALL_MOE
    experts = raw.need("num_experts") if all_moe else int(raw.get("num_experts") or 0)
    if all_moe and experts <= 0:
        raise CheckpointError(f"{raw.source}: num_experts must be positive: every Qwen3.5-MoE layer is MoE")
    # Qwen3.5-MoE makes every layer MoE and always renormalises the top-k weights.
    qwen3_next = text == "Qwen3NextForCausalLM"
    routing = dict(  # Qwen's names for the MoE fields; its shared expert is the family's own (HybridMoE)
        n_routed_experts=experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 1)) if experts else 1,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if qwen3_next else True,
    )
    return HybridConfig(
        **{**common_fields(raw, architecture, layout, all_moe), **routing},
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        use_qk_norm=True,
        first_k_dense_replace=0,
        layer_types=read_layer_types(raw),
        linear_num_key_heads=raw.need("linear_num_key_heads"),
        linear_num_value_heads=raw.need("linear_num_value_heads"),
        linear_key_head_dim=raw.need("linear_key_head_dim"),
        linear_value_head_dim=raw.need("linear_value_head_dim"),
        linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim", 4)),
        fused_qkvz=FUSED_PROJECTION[text],
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)) if qwen3_next else 1,
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()) if qwen3_next else (),
    )


class OffsetRMSNorm(RMSNorm):
    """Qwen3-Next's RMSNorm: the weight is stored as an offset from 1 (zeros mean identity scaling)."""

    def __init__(self, size: int, eps: float):
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), x.shape[-1:], eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Grouped-query attention whose q_proj also gives a per-feature output gate, with q/k norms."""

    def __init__(self, config: HybridConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, 2 * self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary, cache: KVCache | None) -> torch.Tensor:
        batch, length, _ = x.shape
        q, gate = self.q_proj(x).view(batch, length, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), *rotary)
        k = apply_rotary(self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)), *rotary)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim)
        (k, v), mask = attention_span(cache, self.layer_id, positions, k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        ).transpose(1, 2)
        return row_parallel(self.o_proj, (out * gate.sigmoid()).reshape(batch, length, -1))

    def fill_cache(self, x: torch.Tensor, positions: torch.Tensor, rotary, cache: KVCache) -> None:
        """Only what the cache keeps of a pass over `x`: the new positions' keys and values."""
        batch, length, _ = x.shape
        k = apply_rotary(self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)), *rotary)
        cache.update(self.layer_id, positions, k, self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim))


class SoftmaxRouter(nn.Module):
    """Softmax over the experts, top-k, optionally renormalised."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: [N, H]
        logits = F.linear(x, self.weight)
        weights, expert_ids = logits.float().softmax(-1).topk(self.config.num_experts_per_tok, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(logits.dtype), expert_ids


class HybridMoE(MoE):
    router = SoftmaxRouter

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        # Reduced with the routed experts (the gate, replicated, scales each token's partial sum alike).
        self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size, reduce=False)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def shared(self, flat: torch.Tensor) -> torch.Tensor:
        return self.shared_expert_gate(flat).sigmoid() * self.shared_expert(flat)


class DecoderLayer(DecoderBlock):
    """A linear-attention or full-attention block (as `layer_types` says), then a dense MLP or the MoE."""

    attention = GatedAttention
    moe_type = HybridMoE
    norm_type = OffsetRMSNorm

    def add_mixer(self, config: HybridConfig, layer_id: int) -> None:
        if config.is_linear_attention(layer_id):
            self.linear_attn = GatedDeltaNet(config, layer_id)
        else:
            super().add_mixer(config, layer_id)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn


class MtpLayer(DecoderLayer):
    """The `mtp.*` drafter as one module: `mtp.layers.N.*` (a full-attention block) and the parts vLLM holds
    once beside its layers (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`; runtime/drafter/mtp.py maps them).
    `shared_head.head` is the target's lm_head: the layout ships no own head."""

    def __init__(self, config: HybridConfig, layer_id: int):
        super().__init__(config, layer_id)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hidden, eps)
        self.norm = OffsetRMSNorm(hidden, eps)
        self.shared_head = nn.Module()
        self.shared_head.head = ParallelLMHead(hidden, config.vocab_size)

    def add_mixer(self, config: HybridConfig, layer_id: int) -> None:
        self.self_attn = GatedAttention(config, layer_id)  # MTP layer ids count from 0: never linear attention

    def mtp_input(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kernels.check_mtp_input(embeds, prev_hidden)
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(prev_hidden)], dim=-1))

    def mtp_output(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm(hidden)  # vLLM returns the normed state, and the next chain step is fed it
        return normed, self.shared_head.head(normed)
