"""The recurrent state of linear-attention layers (Gated DeltaNet), and how a speculative step rolls it back.

A KV cache needs no rollback: entries past a row's position are masked and overwritten. A recurrent
state has no positions: once the verification pass has run the pending token and k drafts through it,
it holds all of them. So a forward keeps the state after each of its positions ("pending"), and the
step commits, per row, the one after the last accepted token (docs/engine-semantics.md §Hybrid models).
Verification passes are short (k + 1 tokens), so keeping every position costs k + 1 states; a prompt
pass keeps only its causal-conv windows per position and, for the delta-rule state, masks the padding
past each row's end so that its final state is the one after the row's last token.
"""

from __future__ import annotations

import torch

from specdoctor.runtime.cache.regroup import joined_rows


class LinearStates:
    """Per linear-attention layer: each row's causal-conv window [B, C, K-1] (the last K-1 inputs) and its
    delta-rule state [B, heads, key_dim, value_dim] in fp32."""

    def __init__(
        self,
        layer_ids: list[int],
        batch: int,
        conv_shape: tuple[int, int],  # (channels, kernel - 1)
        state_shape: tuple[int, int, int],  # (value heads, key dim, value dim)
        dtype: torch.dtype,
        device: torch.device | str,
        rollback: bool = True,
    ):
        self.conv = {i: torch.zeros(batch, *conv_shape, dtype=dtype, device=device) for i in layer_ids}
        self.recurrent = {i: torch.zeros(batch, *state_shape, dtype=torch.float32, device=device) for i in layer_ids}
        # `rollback=False` reproduces an engine that keeps the state after every verified token, rejected or not.
        self.rollback = rollback
        self.valid_end: torch.Tensor | None = None  # [B]: positions at or past it are padding
        self.keep_positions = False
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, valid_end: torch.Tensor | None, keep_positions: bool) -> None:
        """Before a forward: which positions are real, and whether each position's state is kept (a
        verification pass) or only the final one (a prompt pass, whose padding is masked)."""
        self.valid_end, self.keep_positions = valid_end, keep_positions
        self.pending.clear()

    def stage(self, layer_id: int, windows: torch.Tensor, states: torch.Tensor) -> None:
        """A layer's states after its forward: windows [B, T, C, K-1]; states [B, T or 1, heads, Dk, Dv]."""
        self.pending[layer_id] = (windows, states)

    def commit(self, index: torch.Tensor, rows: torch.Tensor) -> None:
        """Keep, for each row in `rows` [B] (bool), the states after position `index` [B] of the last forward."""
        for layer_id, (windows, states) in self.pending.items():
            last = windows.shape[1] - 1
            at = index if self.rollback or not self.keep_positions else torch.full_like(index, last)
            batch = torch.arange(len(at), device=at.device)
            keep = rows[:, None, None]
            self.conv[layer_id] = torch.where(keep, windows[batch, at], self.conv[layer_id])
            chosen = states[batch, at] if states.shape[1] > 1 else states[:, 0]
            self.recurrent[layer_id] = torch.where(keep[..., None], chosen, self.recurrent[layer_id])
        self.pending.clear()

    @staticmethod
    def regroup(sources: list["LinearStates"], rows: list[int] | None) -> "LinearStates":
        """These states' rows, concatenated in order, then `rows` of them (None: all)."""
        first = sources[0]
        joined = LinearStates.__new__(LinearStates)
        joined.rollback, joined.valid_end, joined.keep_positions, joined.pending = first.rollback, None, False, {}
        joined.conv = {i: joined_rows([s.conv[i] for s in sources], rows) for i in first.conv}
        joined.recurrent = {i: joined_rows([s.recurrent[i] for s in sources], rows) for i in first.recurrent}
        return joined
