"""What the live drafter holds, measured on the drafter's rank: per tensor its statistics and how
its sampled rows compare with the checkpoint tensor a correct loader reads, or, for a module with no
weight, what it hands back. The checks (checks/drafter.py) turn these measurements into findings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specdoctor import kernels
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.policy import has_real_weight

SAMPLED_ROWS = 64


@dataclass
class Placeholder:
    """A drafter module with no weight: a PPMissingLayer aliased where a tensor was expected."""

    module_type: str
    echoes_ids: bool  # its forward hands back the token ids it was given


@dataclass
class DrafterState:
    provenance: dict[str, str]  # drafter tensor -> where it came from (the runtime's own label)
    unfilled: list[str]  # tensors neither loaded nor aliased to a real tensor
    tensors: dict[str, dict] = field(default_factory=dict)  # statistics per materialised tensor
    placeholders: dict[str, Placeholder] = field(default_factory=dict)


def tensor_stats(tensor: torch.Tensor) -> dict:
    """NaN/Inf counts, zero fraction, and moments of the finite values (one pass through the kernels);
    duplicate rows for matrices, from per-row fingerprints."""
    raw = kernels.tensor_stats(tensor)
    numel = tensor.numel()
    finite = numel - raw["nan"] - raw["posinf"] - raw["neginf"]
    mean = raw["sum"] / finite if finite else float("nan")
    variance = (raw["sumsq"] / finite - mean * mean) * finite / (finite - 1) if finite > 1 else float("nan")
    stats = {
        "numel": numel,
        "nan": raw["nan"],
        "inf": raw["posinf"] + raw["neginf"],
        "zero_fraction": raw["zeros"] / numel if numel else 0.0,
        "mean": mean,
        "std": math.sqrt(max(variance, 0.0)) if finite > 1 else float("nan"),
        "absmax": raw["absmax"] if finite else float("nan"),
    }
    if tensor.dim() == 2 and tensor.shape[0] > 1:
        # Equal rows (e.g. an all-zero table) share a fingerprint: a projection on a fixed random direction.
        projection = torch.randn(tensor.shape[1], generator=torch.Generator().manual_seed(0)).to(tensor.device)
        rows = torch.arange(tensor.shape[0], device=tensor.device)
        _, fingerprints = kernels.row_fingerprints(tensor.detach(), rows, projection)
        stats["duplicate_row_fraction"] = 1.0 - fingerprints.unique().numel() / tensor.shape[0]
    return stats


def fingerprint_mismatch(checkpoint: Checkpoint, key: str, loaded: torch.Tensor) -> tuple[int, int]:
    """(mismatching, compared) rows between the loaded tensor and rows read from the checkpoint."""
    if loaded.dim() == 1:
        expected = checkpoint.read(key).to(loaded.dtype)
        return int(not torch.equal(loaded.detach().cpu(), expected)), 1
    count = loaded.shape[0]
    rows = sorted({int(r) for r in torch.linspace(0, count - 1, min(SAMPLED_ROWS, count))})
    mismatches = 0
    for row in rows:
        expected = checkpoint.read(key, rows=(row, row + 1)).to(loaded.dtype)
        mismatches += int(not torch.equal(loaded[row : row + 1].detach().cpu(), expected))
    return mismatches, len(rows)


def measure_drafter(model) -> DrafterState:
    """Measure the live drafter of a RankModel on the last rank: every tensor against the checkpoint."""
    device = model.device
    state = DrafterState(dict(model.provenance.sources), model.provenance.unfilled())
    kind = model.kind
    for name in kind.tensor_names(model.drafter):
        module_name, leaf = name.rsplit(".", 1)
        module = model.drafter.get_submodule(module_name)
        if not has_real_weight(module):
            output = module(torch.arange(3, device=device)[None])
            echoed = isinstance(output, torch.Tensor) and not output.is_floating_point()
            state.placeholders[name] = Placeholder(type(module).__name__, echoed)
            continue
        tensor = getattr(module, leaf)
        stats = tensor_stats(tensor) if module_name.endswith(kind.stats_parts) else {"numel": tensor.numel()}
        source = kind.expected_source(name)
        if source is not None:
            checkpoint, key = source
            stats["mismatched_rows"], stats["compared_rows"] = fingerprint_mismatch(checkpoint, key, tensor)
            stats["checkpoint_key"] = key
        state.tensors[name] = stats
    return state
