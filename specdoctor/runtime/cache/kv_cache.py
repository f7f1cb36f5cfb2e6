"""Key/value cache indexed by each sequence's absolute positions.

Every write lands at the token's own position, so sequences of different lengths share one
batch, and rolling back rejected speculative tokens needs no copy: entries past a sequence's
current position are masked out by causality and overwritten by the next write.
"""

from __future__ import annotations

import torch

from specdoctor.runtime.cache.linear_state import LinearStates
from specdoctor.runtime.cache.regroup import joined_rows


class KVCache:
    """Per layer, one buffer per cached entry (standard attention: keys and values; MLA: its latent and
    rotary key; DSA adds its indexer keys), each [B, max_len, heads, width]."""

    def __init__(
        self,
        layer_ids: list[int],
        batch: int,
        max_len: int,
        shapes: tuple[tuple[int, int], ...],  # (heads, width) of each entry
        dtype: torch.dtype,
        device: torch.device | str,
        states: LinearStates | None = None,  # hybrid models: the linear-attention layers' recurrent states
    ):
        self.batch, self.max_len, self.states = batch, max_len, states
        self.entries = {
            i: [torch.zeros(batch, max_len, heads, width, dtype=dtype, device=device) for heads, width in shapes]
            for i in layer_ids
        }
        self._plan: tuple[torch.Tensor, torch.Tensor] | None = None

    def plan(self, positions: torch.Tensor, whole_block: bool = False) -> None:
        """Before each forward over the cache (its entry point calls this once, outside any compiled
        region): the batch rows and the mask [B, 1, T, span] every layer of that forward uses. Causal by
        absolute position: a query sees every key at or before its own position; with `whole_block` (a block
        drafter's non-causal block) every query of a row sees every key up to the row's last position."""
        self.plan_keys(positions, self.keys(int(positions.max()) + 1, positions.device), whole_block)

    def keys(self, span: int, device: torch.device) -> torch.Tensor:
        """The key positions [span] a pass reaching position span - 1 attends over (0 to span - 1)."""
        if span > self.max_len:
            raise ValueError(f"position {span - 1} is beyond the KV cache length {self.max_len}")
        return torch.arange(span, device=device)

    def plan_keys(self, positions: torch.Tensor, keys: torch.Tensor, whole_block: bool = False) -> None:
        """`plan` over `keys` (from `keys`), which reach at least every position: no read from the device, so a
        compiled draft chain plans each of its steps inside its graph."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        last = positions.amax(dim=1, keepdim=True).expand_as(positions) if whole_block else positions
        self._plan = (rows, keys <= last[:, None, :, None])

    def causal_mask(self) -> torch.Tensor:
        return self._plan[1]

    def update(
        self,
        layer_id: int,
        positions: torch.Tensor,  # [B, T] absolute positions of the new tokens
        *new: torch.Tensor,  # each [B, T, heads, width], in the order of the shapes
    ) -> list[torch.Tensor]:
        """Store the new entries; return every entry up to the furthest position, [B, S, heads, width] each."""
        rows, mask = self._plan
        span = mask.shape[-1]  # read from a tensor, so a compiled step treats it as a size, not a constant
        stored = self.entries[layer_id]
        for buffer, value in zip(stored, new, strict=True):
            buffer[rows, positions] = value
        return [buffer[:, :span] for buffer in stored]

    def begin(self, valid_end: torch.Tensor | None, keep_positions: bool) -> None:
        """Before a forward that will be committed (see LinearStates.begin); nothing to do without states."""
        if self.states:
            self.states.begin(valid_end, keep_positions)

    def commit(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """After it: keep each row's recurrent states after position `index` (see LinearStates.commit)."""
        if self.states:
            self.states.commit(index, rows)

    @staticmethod
    def regroup(caches: list["KVCache"], rows: list[int] | None = None) -> "KVCache":
        """One cache holding these caches' rows, concatenated in order, then `rows` of them (None: all);
        each is padded to the longest one's length first (requests joining a running batch)."""
        first, max_len = caches[0], max(cache.max_len for cache in caches)
        joined = KVCache.__new__(KVCache)
        joined.max_len, joined._plan = max_len, None
        joined.entries = {
            layer: [joined_rows([c.entries[layer][n] for c in caches], rows, max_len) for n in range(len(buffers))]
            for layer, buffers in first.entries.items()
        }
        joined.states = LinearStates.regroup([c.states for c in caches], rows) if first.states else None
        joined.batch = len(rows) if rows is not None else sum(cache.batch for cache in caches)
        return joined


def new_cache(
    config, layer_ids: list[int], batch: int, max_len: int, dtype, device, drafter: bool = False, rollback: bool = True
) -> KVCache:
    """A cache for the given layers (a stage's, or the drafter's MTP layers) of a model with this config:
    keys and values for attention layers, recurrent states for linear-attention ones."""
    linear = [] if drafter else [i for i in layer_ids if config.is_linear_attention(i)]
    attention = [i for i in layer_ids if i not in linear]
    states = None
    if linear:
        conv, state = config.linear_state_shapes
        states = LinearStates(linear, batch, conv, state, dtype, device, rollback)
    return KVCache(attention, batch, max_len, config.kv_cache_shapes, dtype, device, states)
