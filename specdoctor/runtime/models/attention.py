"""Grouped-query attention with rotary positions, and the causal span every attention kind shares."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.models.layers import FusedWeights, RMSNorm, concat_weights
from specdoctor.runtime.models.packed import any_packed
from specdoctor.runtime.models.parallel_layers import row_parallel
from specdoctor.runtime.models.rope import apply_rotary


class Attention(FusedWeights):
    """Grouped-query attention with partial rotary embedding and optional q/k norm."""

    output_bias = False  # whether `attention_bias` also gives o_proj a bias (GLM-4.5's does not)

    def __init__(self, config: ModelConfig, layer_id: int, input_size: int | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        width = input_size or hidden  # wider where a layer reads more than the residual stream (EAGLE-3's first)
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias and self.output_bias)
        if config.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.use_qk_norm = config.use_qk_norm
        self.fuse()

    def fuse(self) -> None:
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_weight, self.qkv_bias = (None, None) if any_packed(*parts) else concat_weights(parts)

    def qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused q/k/v projection's weight [(heads + 2 kv_heads) D, H] and bias."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        bias = self.joined(self.qkv_bias, [p.bias for p in parts] if self.qkv_bias is not None else [])
        return self.joined(self.qkv_weight, [p.weight for p in parts]), bias

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T]
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [B, T, R]
        cache: KVCache | None,
    ) -> torch.Tensor:  # [B, T, H]
        batch, length, _ = x.shape
        kv_size = self.num_kv_heads * self.head_dim
        if self.qkv_weight is None:  # packed weights: one quantised GEMM each
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        else:
            qkv = F.linear(x, *self.qkv())
        qk, v = qkv.split([self.num_heads * self.head_dim + kv_size, kv_size], -1)
        heads = self.num_heads
        qk = qk.view(batch, length, heads + self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :, :heads]), self.k_norm(qk[:, :, heads:])], dim=2)
        q, k = apply_rotary(qk, *rotary).split([heads, self.num_kv_heads], dim=2)  # q and k rotated together
        v = v.view(batch, length, self.num_kv_heads, self.head_dim)
        (k, v), mask = attention_span(cache, self.layer_id, positions, k, v)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        return row_parallel(self.o_proj, out.transpose(1, 2).reshape(batch, length, -1))

    def fill_cache(self, x: torch.Tensor, positions: torch.Tensor, rotary, cache: KVCache) -> None:
        """Only what the cache keeps of a pass over `x` [B, T, H]: the new positions' keys and values."""
        batch, length, _ = x.shape
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            k = self.k_norm(k)
        cache.update(self.layer_id, positions, apply_rotary(k, *rotary), v)


def attention_span(cache: KVCache | None, layer_id: int, positions: torch.Tensor, *entries: torch.Tensor):
    """(the entries over every position the queries see, each [B, S, ...], and the causal mask [B, 1, T, S]):
    without a cache the new entries alone, else the cache's after it stores them."""
    if cache is None:
        # Causal by absolute position: a query sees every key at or before its own position.
        return entries, positions[:, None, None, :] <= positions[:, None, :, None]
    return cache.update(layer_id, positions, *entries), cache.causal_mask()
