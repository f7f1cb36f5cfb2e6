"""Kernels for the hot paths, each with a plain-torch reference (`reference.py`).

Every function here dispatches: Triton on CUDA tensors, the torch reference on CPU tensors.
SPECDOCTOR_KERNELS=triton|torch forces one; Triton on CPU tensors then needs TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from specdoctor.errors import SpecdoctorError
from specdoctor.kernels import reference

MODES = ("auto", "triton", "torch")


def backend(tensor: torch.Tensor) -> str:
    mode = os.environ.get("SPECDOCTOR_KERNELS", "auto")
    if mode not in MODES:
        raise SpecdoctorError(f"SPECDOCTOR_KERNELS={mode!r}: choose one of {', '.join(MODES)}")
    if mode == "auto":
        return "triton" if tensor.is_cuda and importlib.util.find_spec("triton") else "torch"
    return mode


def _implementation(tensor: torch.Tensor, module: str, name: str):
    if backend(tensor) == "torch":
        return getattr(reference, name)
    return getattr(importlib.import_module(f"specdoctor.kernels.{module}"), name)


def tensor_stats(x: torch.Tensor) -> dict[str, float]:
    return _implementation(x, "triton_stats", "tensor_stats")(x)


def row_fingerprints(x, rows, projection):
    return _implementation(x, "triton_stats", "row_fingerprints")(x, rows, projection)


def rejection_greedy(draft_ids, cu_num_draft, target_argmax, bonus_ids, max_k: int):
    return _implementation(draft_ids, "triton_verify", "rejection_greedy")(
        draft_ids, cu_num_draft, target_argmax, bonus_ids, max_k
    )


def sample_recovered(draft_ids, draft_probs, target_probs, exponential):
    return _implementation(target_probs, "triton_verify", "sample_recovered")(
        draft_ids, draft_probs, target_probs, exponential
    )


def rejection_random(draft_ids, cu_num_draft, draft_probs, target_probs, uniform, recovered_ids, bonus_ids, max_k):
    return _implementation(target_probs, "triton_verify", "rejection_random")(
        draft_ids, cu_num_draft, draft_probs, target_probs, uniform, recovered_ids, bonus_ids, max_k
    )


def check_mtp_input(embeds, hidden) -> None:
    """Engines fail at the MTP input when the drafter's embedding aliases a placeholder that hands back
    token ids; every family's drafter fails the same way instead of reading out of bounds (a kernel would)."""
    if embeds.shape != hidden.shape or not embeds.is_floating_point():
        raise ValueError(
            f"MTP input: the embedding lookup gave {embeds.dtype} {tuple(embeds.shape)}, the hidden states are "
            f"{tuple(hidden.shape)} (an embedding that hands back token ids?)"
        )


def mtp_input(embeds, hidden, positions, enorm, hnorm, eps: float):
    check_mtp_input(embeds, hidden)
    return _implementation(embeds, "triton_mtp", "mtp_input")(embeds, hidden, positions, enorm, hnorm, eps)


def w4a16_matmul(x, packed, scales, zeros, group_size: int, packing: str):
    return _implementation(x, "triton_quant", "w4a16_matmul")(x, packed, scales, zeros, group_size, packing)


def fp8_block_matmul(x, weight, scale_inv, block: tuple[int, int]):
    return _implementation(x, "triton_quant", "fp8_block_matmul")(x, weight, scale_inv, block)
