"""Building blocks shared by the model families, with the checkpoints' parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor import kernels
from specdoctor.kernels.reference import rms_norm
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.kv_cache import KVCache
from specdoctor.runtime.models.rope import apply_rotary


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


def concat_weights(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Copy the linears' weights (and biases) into one tensor each and make every part a view of it.
    The parts keep the checkpoint's names, so loading a part fills the whole, and one matmul
    replaces several: on a small model each op costs more in overhead than in arithmetic."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    bias = torch.cat([linear.bias.detach() for linear in linears]) if linears[0].bias is not None else None
    start = 0
    for linear in linears:
        end = start + linear.weight.shape[0]
        linear.weight = nn.Parameter(weight[start:end])
        if bias is not None:
            linear.bias = nn.Parameter(bias[start:end])
        start = end
    return weight, bias


class FusedWeights(nn.Module):
    """A module whose parts share one storage (see `concat_weights`). Moving or re-allocating it
    (`.to`, `.to_empty`) gives each parameter new storage, so the parts are joined again after.
    Training reads the parts themselves (`joined`), so the gradients reach the parameters the
    checkpoint names, and the optimiser's in-place steps land in the shared storage."""

    def fuse(self) -> None:
        raise NotImplementedError

    def joined(self, fused: torch.Tensor | None, parts: list[torch.Tensor]) -> torch.Tensor | None:
        """The fused tensor for this forward: the shared storage, or, in training with gradients on, the
        parts joined again (the same values, differentiable)."""
        if fused is None or not (self.training and torch.is_grad_enabled()):
            return fused
        return torch.cat(parts).view(fused.shape)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.fuse()
        return self


class Attention(FusedWeights):
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
        self.fuse()

    def fuse(self) -> None:
        self.qkv_weight, self.qkv_bias = concat_weights([self.q_proj, self.k_proj, self.v_proj])

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
        qk, v = F.linear(x, *self.qkv()).split([self.num_heads * self.head_dim + kv_size, kv_size], -1)
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
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


def attention_span(cache: KVCache | None, layer_id: int, positions: torch.Tensor, *entries: torch.Tensor):
    """(the entries over every position the queries see, each [B, S, ...], and the causal mask [B, 1, T, S]):
    without a cache the new entries alone, else the cache's after it stores them."""
    if cache is None:
        # Causal by absolute position: a query sees every key at or before its own position.
        return entries, positions[:, None, None, :] <= positions[:, None, :, None]
    return cache.update(layer_id, positions, *entries), cache.causal_mask()


class MLP(FusedWeights):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.fuse()

    def fuse(self) -> None:
        self.gate_up = concat_weights([self.gate_proj, self.up_proj])[0]  # [2I, H]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.joined(self.gate_up, [self.gate_proj.weight, self.up_proj.weight])).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


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


# Below this many bytes of gathered expert weights a step runs every routed expert it picked in one
# batched matmul over copies of their weights. Above it, a layer whose routed experts together take at
# most EVERY_EXPERT_LIMIT_BYTES runs every expert over every token (weighted 0 where not picked), and a
# larger one loops over the experts hit, reading them in place (and its expert list on the host).
GATHER_LIMIT_BYTES = 16 << 20
EVERY_EXPERT_LIMIT_BYTES = 16 << 20


class MoE(FusedWeights):
    router: type[nn.Module] = Router  # (config) -> module returning (weights [N, k], expert ids [N, k])

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = self.router(config)
        self.top_k = config.num_experts_per_tok
        size = config.moe_intermediate_size
        self.experts = nn.ModuleList(MLP(config.hidden_size, size) for _ in range(config.n_routed_experts))
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size, size * config.n_shared_experts)
        self.fuse()

    def fuse(self) -> None:
        experts, (size, hidden) = len(self.experts), self.experts[0].gate_proj.weight.shape
        self.expert_bytes = self.experts[0].gate_proj.weight.nbytes * 3  # gate, up and down
        parts = [linear for expert in self.experts for linear in (expert.gate_proj, expert.up_proj)]
        self.gate_up = concat_weights(parts)[0].view(experts, 2 * size, hidden)  # [E, 2I, H]
        self.down = concat_weights([expert.down_proj for expert in self.experts])[0].view(experts, hidden, size)
        for index, expert in enumerate(self.experts):
            expert.gate_up = self.gate_up[index]

    def gathered_token_limit(self) -> int:
        """The most tokens a pass routes through `gathered_experts`."""
        return GATHER_LIMIT_BYTES // (self.top_k * self.expert_bytes)

    def loop_token_limit(self) -> int | None:
        """The most tokens a pass can take without the per-expert loop, which reads its expert list on the
        host (so a compiled pass must stay under it); None: any number."""
        return (
            None if len(self.experts) * self.expert_bytes <= EVERY_EXPERT_LIMIT_BYTES else self.gathered_token_limit()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        flat = x.reshape(-1, x.shape[-1])
        weights, expert_ids = self.gate(flat)
        if flat.shape[0] <= self.gathered_token_limit():
            out = self.gathered_experts(flat, weights, expert_ids)
        elif self.loop_token_limit() is None:
            out = self.every_expert(flat, weights, expert_ids)
        else:
            out = self.looped_experts(flat, weights, expert_ids)
        return (out + self.shared(flat)).view_as(x)

    def shared(self, flat: torch.Tensor) -> torch.Tensor | float:  # [N, H] -> what the shared experts add
        return self.shared_experts(flat) if hasattr(self, "shared_experts") else 0.0

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every routed expert's gate/up [E, 2I, H] and down [E, H, I] projections."""
        gate_up = [linear.weight for expert in self.experts for linear in (expert.gate_proj, expert.up_proj)]
        down = [expert.down_proj.weight for expert in self.experts]
        return self.joined(self.gate_up, gate_up), self.joined(self.down, down)

    def gathered_experts(self, flat, weights, expert_ids) -> torch.Tensor:  # [N, H], [N, k], [N, k] -> [N, H]
        tokens, per_token = expert_ids.shape
        ids = expert_ids.reshape(-1)
        inputs = flat[:, None, :].expand(tokens, per_token, -1).reshape(tokens * per_token, 1, -1)
        gate_up, down = self.expert_weights()
        # index_select copies whole expert matrices; advanced indexing (w[ids]) is several times slower.
        gate, up = torch.bmm(inputs, gate_up.index_select(0, ids).transpose(1, 2)).chunk(2, dim=-1)
        routed = torch.bmm(F.silu(gate) * up, down.index_select(0, ids).transpose(1, 2))  # [N*k, 1, H]
        return (routed.view(tokens, per_token, -1) * weights[..., None].to(flat.dtype)).sum(1)

    def every_expert(self, flat, weights, expert_ids) -> torch.Tensor:  # [N, H], [N, k], [N, k] -> [N, H]
        picked = torch.zeros(flat.shape[0], len(self.experts), dtype=flat.dtype, device=flat.device)
        picked.scatter_(1, expert_ids, weights.to(flat.dtype))  # [N, E]: the routing weight, 0 where not picked
        gate_up, down = self.expert_weights()
        gate, up = torch.matmul(flat, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
        routed = torch.matmul(F.silu(gate) * up, down.transpose(1, 2))  # [E, N, H]
        return (routed * picked.T[:, :, None]).sum(0)

    def looped_experts(self, flat, weights, expert_ids) -> torch.Tensor:
        out = torch.zeros_like(flat)
        for expert in expert_ids.unique().tolist():
            token, slot = torch.where(expert_ids == expert)
            routed = self.experts[expert](flat[token]) * weights[token, slot, None].to(flat.dtype)
            out.index_add_(0, token, routed)
        return out


class SharedHead(nn.Module):
    """An MTP layer's output head: its own norm and vocabulary projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class DecoderBlock(nn.Module):
    """A token mixer then a dense MLP or MoE (`config.is_moe_layer`), each pre-normed with a residual.
    A family's block sets `attention` (GLM-4.5: grouped-query attention; DeepSeek-V3: MLA) and, where its
    own differ, `moe_type` and `norm_type` (not `norm`: a module may carry that name); a hybrid family
    overrides `add_mixer` to pick the mixer per layer."""

    attention: type[nn.Module]
    moe_type: type[nn.Module] = MoE
    norm_type: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.add_mixer(config, layer_id)
        if config.is_moe_layer(layer_id):
            self.mlp = self.moe_type(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = self.norm_type(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_type(config.hidden_size, config.rms_norm_eps)

    def add_mixer(self, config: ModelConfig, layer_id: int) -> None:
        self.self_attn = self.attention(config, layer_id)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T]
        rotary: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None,
    ) -> torch.Tensor:  # [B, T, H]
        x = x + self.mixer(self.input_layernorm(x), positions, rotary, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekMtpLayer(nn.Module):
    """What makes a family's decoder block a DeepSeek-style MTP layer (docs/engine-semantics.md §MTP step):
    the norms and projection of its input, and its own output head. A family's MTP layer is
    `class MtpLayer(DeepseekMtpLayer, DecoderLayer)`."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = SharedHead(config)

    def mtp_input(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The block's input [B, T, H] from the next tokens' embeddings and the previous hidden states."""
        eps = self.enorm.eps
        return self.eh_proj(
            kernels.mtp_input(embeds, prev_hidden, positions, self.enorm.weight, self.hnorm.weight, eps)
        )

    def mtp_output(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden state the next chain step is fed: the block's output, the logits)."""
        return hidden, self.shared_head.head(self.shared_head.norm(hidden))
