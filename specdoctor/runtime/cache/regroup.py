"""Regrouping batch rows: requests join a running batch (concatenation) and leave it (selection)."""

from __future__ import annotations

import torch


def take_rows(tensor: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """`tensor`'s rows (first dimension) in the order given; None keeps them all."""
    if rows is None:
        return tensor
    return tensor[torch.tensor(rows, dtype=torch.long, device=tensor.device)]


def pad_length(buffer: torch.Tensor, length: int) -> torch.Tensor:
    """[B, L, ...] zero-padded along L to `length`."""
    if buffer.shape[1] == length:
        return buffer
    return torch.cat([buffer, buffer.new_zeros(buffer.shape[0], length - buffer.shape[1], *buffer.shape[2:])], dim=1)
