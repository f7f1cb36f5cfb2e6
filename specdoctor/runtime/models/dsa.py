"""DeepSeek Sparse Attention's indexer (DeepSeek-V3.2, GLM-5): which cached tokens each query attends to.

The score of key t for a query is sum over the indexer's heads h of
`weights_proj(x)_h · n_heads^-0.5 · relu(q_h · k_t · head_dim^-0.5)` (transformers' order of operations);
the query keeps its `index_topk` best causal keys, and all of them while it has no more than that.

The choice must not depend on the pass's shape, or speculative decoding is not lossless: the same query
is verified among k+1 queries and decoded alone, over spans of different lengths. So (docs/engine-semantics.md
§DSA tie order):
- the scores are computed in float64 from the indexer's q, k and head weights (model dtype, as transformers
  computes them): a float32 batched matmul rounds one query's scores differently by the number of queries and
  keys in the pass (~1e-7), float64 by ~1e-15, and exact ties (keys whose every head's dot product is negative
  score exactly 0) stay exact. q, k and the weights themselves carry their pass's rounding, as every
  activation does: two keys within that rounding of each other at the boundary can still swap;
- ties are broken by position: among equal scores the earlier key wins (a stable sort, best first),
  where torch.topk leaves the order of equal values unspecified (it changes with the row's length).
"""

from __future__ import annotations

import torch
from torch import nn

from specdoctor.runtime.models.rope import apply_rotary, apply_rotary_interleaved


def index_scores(
    q: torch.Tensor,  # [B, T, heads, head_dim], rotated
    keys: torch.Tensor,  # [B, S, head_dim], rotated
    weights: torch.Tensor,  # [B, T, heads]: weights_proj(x)
) -> torch.Tensor:  # [B, T, S] float64
    """Every key's index score for every query, in float64 (+0.0 for an exact zero, never -0.0)."""
    heads, head_dim = q.shape[-2:]
    dots = torch.einsum("bthd,bsd->bths", q.double(), keys.double())
    per_head = (dots * head_dim**-0.5).relu()
    scores = torch.einsum("bth,bths->bts", weights.double() * heads**-0.5, per_head)
    return scores.masked_fill(scores == 0, 0.0)  # -0.0 and +0.0 are one score (a radix sort tells them apart)


def top_keys(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The `topk` best keys of each query, [..., topk] indices: higher score first, among equal scores the
    earlier position first. `scores` [..., S] holds -inf where a key is not causal."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :topk]


def boundary_gaps(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Per query, the score of its `topk`-th key minus that of its (topk+1)-th, [...] float64; +inf where it
    has no more than `topk` causal keys (it keeps them all). A gap within rounding is a selection that another
    pass shape (or another engine) may make differently; 0 is a tie the position order decides."""
    if scores.shape[-1] <= topk:
        return scores.new_full(scores.shape[:-1], float("inf"))
    best = scores.sort(dim=-1, descending=True, stable=True).values[..., topk - 1 : topk + 1]
    gap = best[..., 0] - best[..., 1]
    return gap.masked_fill(best[..., 1] == float("-inf"), float("inf"))


class DsaIndexer(nn.Module):
    """The indexer's weights and its choice of keys; `config` is the family's MlaConfig."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wq_b = nn.Linear(config.q_lora_rank, config.index_n_heads * config.index_head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, config.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(config.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, config.index_n_heads, bias=False)

    def rotate(self, x: torch.Tensor, rotary) -> torch.Tensor:  # x: [B, T, heads, index_head_dim]
        """Rotary embedding on the first qk_rope_head_dim features of each head, in this model's layout."""
        if not self.config.indexer_rope_interleave:
            return apply_rotary(x, *rotary)
        rope = self.config.qk_rope_head_dim
        return torch.cat([apply_rotary_interleaved(x[..., :rope], *rotary), x[..., rope:]], dim=-1)

    def keys(self, x: torch.Tensor, rotary) -> torch.Tensor:  # [B, T, H] -> [B, T, 1, index_head_dim]
        return self.rotate(self.k_norm(self.wk(x))[:, :, None], rotary)

    def queries(self, x, q_latent, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [B, T, heads, index_head_dim] rotated, weights [B, T, heads]) in the model's dtype, as transformers
        computes them. x: [B, T, H]; q_latent: [B, T, q_lora_rank]."""
        cfg = self.config
        q = self.wq_b(q_latent).view(*x.shape[:2], cfg.index_n_heads, cfg.index_head_dim)
        return self.rotate(q, rotary), self.weights_proj(x)

    def scores(self, x, q_latent, rotary, keys, mask) -> torch.Tensor:
        """[B, T, S] float64, -inf where `mask` [B, 1, T, S] hides the key; keys: [B, S, 1, index_head_dim]."""
        q, weights = self.queries(x, q_latent, rotary)
        return index_scores(q, keys[:, :, 0], weights).masked_fill(~mask[:, 0], float("-inf"))

    def select(self, x, q_latent, rotary, keys, mask) -> torch.Tensor:
        """The keys each query keeps, [B, 1, T, S] bool (see scores for the arguments)."""
        if keys.shape[1] <= self.config.index_topk:  # no query has more causal keys than it keeps
            return mask
        best = top_keys(self.scores(x, q_latent, rotary, keys, mask), self.config.index_topk)
        return torch.zeros_like(mask[:, 0]).scatter(-1, best, True)[:, None]
