"""The DeepSeek-V3 family: `DeepseekV3ForCausalLM` (and Kimi-K2, which ships that architecture),
`Glm4MoeLiteForCausalLM` (GLM-4.7-Flash, the same attention), and the two with DeepSeek Sparse
Attention, `DeepseekV32ForCausalLM` and `GlmMoeDsaForCausalLM` (GLM-5): config mapping, multi-head
latent attention (MLA), the DSA indexer and the MTP layer.

MLA (DeepSeek-V2/V3): queries through a low-rank q path (`q_a_proj`, `q_a_layernorm`, `q_b_proj`, or
one `q_proj`); keys and values from one compressed latent per token (`kv_a_proj_with_mqa` gives the
latent and a rotary key part shared by every head; `kv_a_layernorm`; `kv_b_proj` expands the latent
into each head's key and value). The KV cache holds the normed latent and the rotated key part, not
the expanded keys: what MLA exists for. Rotary embedding is YaRN-scaled as configured and applied in
DeepSeek's interleaved layout, as vLLM applies it. The MoE is the GLM-4.5 one (sigmoid group-limited
router with `e_score_correction_bias`, shared experts, `first_k_dense_replace` dense layers). DSA: a
lightweight indexer (runtime/models/dsa.py) scores every cached token per query and attention keeps only
the `index_topk` best, the same keys whatever the pass's shape (float64 scores, ties to the earlier
position); up to `index_topk` tokens of context it keeps them all.
docs/engine-semantics.md §MLA and DSA (and §DSA tie order) records the engine facts and where vLLM and
transformers differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor.errors import CheckpointError
from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.config import ModelConfig, MtpKeyLayout, RawConfig, YarnScaling, common_fields
from specdoctor.runtime.models.attention import attention_span
from specdoctor.runtime.models.blocks import DecoderBlock, DeepseekMtpLayer
from specdoctor.runtime.models.dsa import DsaIndexer
from specdoctor.runtime.models.layers import RMSNorm
from specdoctor.runtime.models.parallel_layers import row_parallel
from specdoctor.runtime.models.rope import apply_rotary_interleaved, yarn_mscale

ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
# The rotary layout of each DSA architecture's indexer when the config does not name it with
# `indexer_rope_interleave` (which vLLM reads): transformers' DeepSeek-V3.2 rotates halves, GLM-5 pairs.
INDEXER_ROPE_INTERLEAVED = {"DeepseekV32ForCausalLM": False, "GlmMoeDsaForCausalLM": True}


@dataclass(frozen=True)
class MlaConfig(ModelConfig):
    q_lora_rank: int | None = None  # None: one q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_topk: int | None = None  # DSA: tokens each query attends to; None: dense attention
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_rope_interleave: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_shapes(self) -> tuple[tuple[int, int], ...]:
        shapes = ((1, self.kv_lora_rank), (1, self.qk_rope_head_dim))  # the latent and the shared rotary key
        return shapes + ((1, self.index_head_dim),) if self.index_topk else shapes  # DSA: the indexer's keys


def read_rope(raw: RawConfig) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling or None) from `rope_parameters` (transformers 5) or `rope_scaling`, as vLLM
    reads them. Fields vLLM ignores but transformers honours are refused: the two would compute different
    models (docs/engine-semantics.md §MLA and DSA)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn" or rope.get("attention_factor") is not None:  # vLLM: another scaling with attention_factor
        raise CheckpointError(f"{raw.source}: rope {rope} is not supported (default, or yarn without attention_factor)")
    if rope.get("truncate", True) is not True:
        raise CheckpointError(f"{raw.source}: yarn truncate false is not supported (vLLM ignores it)")
    missing = [name for name in ("factor", "original_max_position_embeddings") if not rope.get(name)]
    if missing:
        raise CheckpointError(f"{raw.source}: yarn rope parameters lack {', '.join(missing)}")
    defaults = YarnScaling(0.0, 0)
    return theta, YarnScaling(
        float(rope["factor"]),
        int(rope["original_max_position_embeddings"]),
        *(
            float(rope.get(name, getattr(defaults, name)))
            for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        ),
    )


def dense_layer_count(raw: RawConfig) -> int:
    """How many leading layers are dense: `first_k_dense_replace` (vLLM reads it), or transformers'
    `mlp_layer_types` when that is a dense prefix; any other pattern is refused, not approximated."""
    if raw.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"{raw.source}: moe_layer_freq {raw.get('moe_layer_freq')} is not supported (1)")
    types = raw.get("mlp_layer_types")
    if not types:
        return int(raw.get("first_k_dense_replace", 0))
    dense = types.index("sparse") if "sparse" in types else len(types)
    if any(kind != "sparse" for kind in types[dense:]):
        raise CheckpointError(f"{raw.source}: mlp_layer_types {types} is not dense layers then MoE layers")
    return dense


def dsa_fields(raw: RawConfig, architecture: str) -> dict:
    """The DSA indexer's fields of a DeepSeek-V3.2 / GLM-5 config; none for the dense-attention ones."""
    if architecture not in INDEXER_ROPE_INTERLEAVED:
        return {}
    if "shared" in (raw.get("indexer_types") or []):
        raise CheckpointError(f"{raw.source}: indexer layers that reuse another layer's top-k are not supported")
    if not raw.get("q_lora_rank"):
        raise CheckpointError(f"{raw.source}: DSA needs q_lora_rank (its indexer reads the q latent)")
    return {
        "index_topk": raw.need("index_topk"),
        "index_n_heads": raw.need("index_n_heads"),
        "index_head_dim": raw.need("index_head_dim"),
        "indexer_rope_interleave": bool(raw.get("indexer_rope_interleave", INDEXER_ROPE_INTERLEAVED[architecture])),
    }


def check_router(raw: RawConfig) -> None:
    """The sigmoid router with the score-correction bias is the one supported: what the architectures define and
    transformers computes whatever the config says. A config that leaves the router unnamed runs so (vLLM then
    routes differently: the pre-flight's `config.router`, checks/preflight.py); one that names another is refused."""
    router = (raw.get("scoring_func") or "sigmoid", raw.get("topk_method") or "noaux_tc")
    if router != ("sigmoid", "noaux_tc"):
        raise CheckpointError(f"{raw.source}: router {router} is not supported (sigmoid scores, noaux_tc top-k)")


def read_mla_config(raw: RawConfig, architecture: str, layout: MtpKeyLayout) -> MlaConfig:
    check_router(raw)
    heads, rope_dim, nope_dim = (
        raw.need("num_attention_heads"),
        raw.need("qk_rope_head_dim"),
        raw.need("qk_nope_head_dim"),
    )
    theta, yarn = read_rope(raw)
    if raw.get("rope_interleave", True) is not True:  # vLLM rotates DeepSeek's interleaved pairs regardless
        raise CheckpointError(f"{raw.source}: rope_interleave false is not supported (vLLM ignores it)")
    return MlaConfig(
        **common_fields(raw, architecture, layout),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=nope_dim + rope_dim,
        rotary_dim=rope_dim,
        rope_theta=theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        use_qk_norm=False,
        first_k_dense_replace=dense_layer_count(raw),
        rope_scaling=yarn,
        q_lora_rank=int(raw.get("q_lora_rank")) if raw.get("q_lora_rank") else None,
        kv_lora_rank=raw.need("kv_lora_rank"),
        qk_nope_head_dim=nope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(raw.get("v_head_dim") or nope_dim),
        **dsa_fields(raw, architecture),
    )


class MlaAttention(nn.Module):
    """Multi-head latent attention; the cache keeps the latent [B, S, 1, kv_lora_rank] and the rotated
    shared key part [B, S, 1, qk_rope_head_dim]."""

    def __init__(self, config: MlaConfig, layer_id: int):
        super().__init__()
        self.config, self.layer_id = config, layer_id
        heads, hidden, bias = config.num_attention_heads, config.hidden_size, config.attention_bias
        if config.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * config.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, config.kv_lora_rank + config.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * config.v_head_dim, hidden, bias=bias)
        self.scaling = config.qk_head_dim**-0.5
        yarn = config.rope_scaling
        if yarn is not None and yarn.mscale_all_dim:  # YaRN sharpens the softmax as it stretches positions
            self.scaling *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
        self.indexer = DsaIndexer(config) if config.index_topk else None

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(queries [B, T, heads, qk_head_dim], the q latent [B, T, q_lora_rank] or None) of x [B, T, H]."""
        if not self.config.q_lora_rank:
            return self.q_proj(x).view(*x.shape[:2], self.config.num_attention_heads, -1), None
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        return self.q_b_proj(q_latent).view(*x.shape[:2], self.config.num_attention_heads, -1), q_latent

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        positions: torch.Tensor,  # [B, T]
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [B, T, qk_rope_head_dim]
        cache: KVCache | None,
    ) -> torch.Tensor:  # [B, T, H]
        cfg = self.config
        batch, length, _ = x.shape
        q, q_latent = self.queries(x)
        q_nope, q_rot = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, :, None]  # [B, T, 1, kv_lora_rank]
        q_rot, k_rot = apply_rotary_interleaved(q_rot, *rotary), apply_rotary_interleaved(k_rot[:, :, None], *rotary)
        entries = [latent, k_rot] + ([self.indexer.keys(x, rotary)] if self.indexer else [])
        entries, mask = attention_span(cache, self.layer_id, positions, *entries)  # each [B, S, 1, *]
        latent, k_rot = entries[:2]
        if self.indexer:
            mask = mask & self.indexer.select(x, q_latent, rotary, entries[2], mask)
        span = latent.shape[1]
        kv = self.kv_b_proj(latent[:, :, 0]).view(batch, span, cfg.num_attention_heads, -1)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, -1, cfg.num_attention_heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=self.scaling
        )
        return row_parallel(self.o_proj, out.transpose(1, 2).reshape(batch, length, -1))


class DecoderLayer(DecoderBlock):
    """DeepSeek-V3's block: MLA, then a dense MLP or MoE."""

    attention = MlaAttention


class MtpLayer(DeepseekMtpLayer, DecoderLayer):
    """DeepSeek-V3's MTP layer (`model.layers.{num_hidden_layers + i}.`), with its own shared_head and,
    in the official checkpoints, its own copy of the embedding."""
