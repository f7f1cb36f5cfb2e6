"""Building blocks of the GLM-4.5 MoE family, with the checkpoint's parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor.kernels.reference import rms_norm
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.kv_cache import KVCache


class PPMissingLayer(nn.Identity):
    """Placeholder for a module another pipeline rank owns: no weight, returns its first argument."""

    def forward(self, *args, **kwargs):
        return args[0] if args else None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        return rms_norm(x, self.weight, self.eps)


def rotary_cos_sin(
    config: ModelConfig,
    positions: torch.Tensor,
    dtype: torch.dtype,  # positions: [B, T]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for the rotary part of each head, [B, T, rotary_dim] each (neox layout)."""
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=positions.device).float() / dim))
    freqs = positions[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of each head; x: [B, T, heads, D], cos/sin: [B, T, R]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    half = rot // 2
    rotated_half = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated_half * sin, x_pass), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with partial rotary embedding and optional q/k norm."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if config.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.use_qk_norm = config.use_qk_norm

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T]
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [B, T, R]
        cache: KVCache | None,
    ) -> torch.Tensor:  # [B, T, H]
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if cache is None:
            key_positions = positions  # [B, S]
        else:
            k, v = cache.update(self.layer_id, k, v, positions)
            key_positions = torch.arange(k.shape[1], device=x.device).expand(batch, -1)
        # Causal by absolute position: a query sees every key at or before its own position.
        mask = key_positions[:, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, S]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid router with a score-correction bias and group-limited top-k (DeepSeek-V3 / GLM-4.5)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # x: [N, H]
        """Return (weights [N, top_k], expert ids [N, top_k])."""
        cfg = self.config
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)  # [N, groups]
        top_groups = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).bool()
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(choice.shape)
        expert_ids = choice.masked_fill(~expert_mask, float("-inf")).topk(cfg.num_experts_per_tok, dim=-1)[1]
        weights = scores.gather(1, expert_ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, expert_ids


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        size = config.moe_intermediate_size
        self.experts = nn.ModuleList(MLP(config.hidden_size, size) for _ in range(config.n_routed_experts))
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        flat = x.reshape(-1, x.shape[-1])
        weights, expert_ids = self.gate(flat)
        out = torch.zeros_like(flat)
        for expert in expert_ids.unique().tolist():
            token, slot = torch.where(expert_ids == expert)
            routed = self.experts[expert](flat[token]) * weights[token, slot, None].to(flat.dtype)
            out.index_add_(0, token, routed)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        return out.view_as(x)


class DecoderLayer(nn.Module):
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
