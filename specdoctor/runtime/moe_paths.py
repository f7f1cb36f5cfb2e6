"""Which path each MoE layer of a CPU rank takes: from how many tokens its experts run as one grouped GEMM,
timed once per expert shape on the rank's threads and kept in the compile cache for later starts."""

from __future__ import annotations

import functools

import torch

from specdoctor.runtime.compile import measured_once
from specdoctor.runtime.models.moe import MoE, measure_grouped_from


def choose_moe_paths(layers: list[MoE], device: torch.device) -> dict[str, int | None]:
    """On the CPU, from how many tokens each MoE layer runs its experts as a grouped GEMM, timed once per expert
    shape on this rank's threads (runtime/models/moe.py) and kept in the compile cache for later starts;
    {expert shape: tokens, or None for never}."""
    measured: dict[str, int | None] = {}
    if device.type != "cpu":  # torch's grouped GEMM on CUDA takes bfloat16 on recent GPUs only: not timed there
        return measured
    for layer in layers:
        # packed experts take another path; experts on the meta device (a rank built alone, past the memory
        # limit) never run, and timing them would fail with a cold cache
        if layer.packed or layer.gate_up.is_meta:
            continue
        shape = "x".join(map(str, layer.gate_up.shape)) + f" {layer.gate_up.dtype}"
        if shape not in measured:
            measured[shape] = measured_once(grouped_from_key(shape), functools.partial(measure_grouped_from, layer))
        layer.grouped_from = measured[shape]
    return measured


def grouped_from_key(shape: str) -> str:
    """Where the compile cache keeps the measured crossover of experts of `shape` on this rank's threads."""
    return f"grouped GEMM from, {torch.get_num_threads()} thread(s), experts {shape}"


def fewest_grouped_tokens(rank_info: list[dict]) -> int | None:
    """The fewest tokens from which any of these ranks' MoE layers run the grouped GEMM (None: none do)."""
    measured = [tokens for info in rank_info for tokens in info["grouped_from"].values() if tokens]
    return min(measured, default=None)
