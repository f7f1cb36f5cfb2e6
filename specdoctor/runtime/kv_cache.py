"""Key/value cache indexed by each sequence's absolute positions.

Every write lands at the token's own position, so sequences of different lengths share one
batch, and rolling back rejected speculative tokens needs no copy: entries past a sequence's
current position are masked out by causality and overwritten by the next write.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        layer_ids: list[int],
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (batch, max_len, num_kv_heads, head_dim)
        self.max_len = max_len
        self.keys = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.values = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}

    def update(
        self,
        layer_id: int,
        k: torch.Tensor,  # [B, T, n_kv, D]
        v: torch.Tensor,  # [B, T, n_kv, D]
        positions: torch.Tensor,  # [B, T] absolute positions of the new tokens
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new entries; return every entry up to the furthest position, [B, S, n_kv, D] each."""
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} is beyond the KV cache length {self.max_len}")
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        self.keys[layer_id][rows, positions] = k
        self.values[layer_id][rows, positions] = v
        span = int(positions.max()) + 1
        return self.keys[layer_id][:, :span], self.values[layer_id][:, :span]
