"""Output buffers for the Triton kernels. With SPECDOCTOR_POISON_OUTPUTS=1 (the tests) they start
full of garbage, so an element a kernel forgets to write fails the comparison with the reference."""

from __future__ import annotations

import os

import torch


def output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if os.environ.get("SPECDOCTOR_POISON_OUTPUTS") != "1":
        return torch.empty(shape, dtype=dtype, device=device)
    poison = float("nan") if dtype.is_floating_point else -7777
    return torch.full(shape, poison, dtype=dtype, device=device)
