"""Regrouping batch rows: requests join a running batch (concatenation) and leave it (selection)."""

from __future__ import annotations

import torch


def take_rows(tensor: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    """`tensor`'s rows (first dimension) in the order given; None keeps them all."""
    if rows is None:
        return tensor
    return tensor.index_select(0, torch.tensor(rows, dtype=torch.long, device=tensor.device))


def joined_rows(tensors: list[torch.Tensor], rows: list[int] | None, length: int | None = None) -> torch.Tensor:
    """These tensors' rows (first dimension) concatenated in order, each zero-padded along the second dimension to
    `length` (None: as they are), then `rows` of them (None: all). A new tensor, each entry written once where a batch
    joins another (rows None) or rows leave one (one tensor): a step's caches are copied whole at each."""
    first = tensors[0]
    if len(tensors) == 1 and (length is None or first.shape[1] == length):
        return first.clone() if rows is None else take_rows(first, rows)
    if length is None:
        return take_rows(torch.cat(tensors), rows)
    joined = first.new_empty(sum(tensor.shape[0] for tensor in tensors), length, *first.shape[2:])
    start = 0
    for tensor in tensors:
        end, filled = start + tensor.shape[0], tensor.shape[1]
        joined[start:end, :filled] = tensor
        joined[start:end, filled:] = 0
        start = end
    return take_rows(joined, rows)
