"""What the live drafter holds, measured on the drafter's rank: per tensor its statistics and how
its sampled rows compare with the checkpoint tensor a correct loader reads, or, for a module with no
weight, what it hands back. The checks (checks/drafter.py) turn these measurements into findings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from specdoctor import kernels
from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.policy import Provenance, has_real_weight
from specdoctor.runtime.models.parallel_layers import is_vocab_parallel
from specdoctor.runtime.sharding import shard_range

SAMPLED_ROWS = 64
# Elements measured per pass: the kernels' float32 temporaries stay near 64 MiB however large the tensor (a
# real vocabulary's embedding is 129,280 x 7,168), and a tensor under it is measured in one pass.
CHUNK_ELEMENTS = 16 << 20
ADDED = ("nan", "posinf", "neginf", "zeros", "sum", "sumsq")
STATS_ROWS = 2048  # rows of a larger matrix measured (evenly spaced): what stays uninitialised spans many


@dataclass
class Placeholder:
    """A drafter module with no weight: a PPMissingLayer aliased where a tensor was expected."""

    module_type: str
    echoes_ids: bool  # its forward hands back the token ids it was given


@dataclass
class TensorRecord:
    """What the drafter's rank measured of one materialised tensor; a field not measured is None."""

    numel: int
    # Its statistics, where its part's are worth a full pass (the kind's stats_parts; tensor_stats).
    nan: int | None = None
    inf: int | None = None
    zero_fraction: float | None = None
    mean: float | None = None
    std: float | None = None
    absmax: float | None = None
    duplicate_row_fraction: float | None = None  # a matrix's
    sampled_rows: int | None = None  # a matrix measured on this many of its rows
    # Against the checkpoint tensor a correct loader reads, where one holds it.
    checkpoint_key: str | None = None
    shape: list[int] | None = None  # where another tensor (another shape than the checkpoint's) is in its place
    checkpoint_shape: list[int] | None = None
    mismatched_rows: int | None = None  # of the sampled rows compared with the checkpoint's
    compared_rows: int | None = None

    @property
    def measured(self) -> bool:
        return self.nan is not None

    def to_dict(self) -> dict:
        """As the report shows it: the fields measured, in this order."""
        return {spec.name: value for spec in fields(self) if (value := getattr(self, spec.name)) is not None}


@dataclass
class DrafterState:
    provenance: Provenance  # where each drafter tensor came from
    unfilled: list[str]  # tensors neither loaded nor aliased to a real tensor
    tensors: dict[str, TensorRecord] = field(default_factory=dict)  # per materialised tensor
    placeholders: dict[str, Placeholder] = field(default_factory=dict)
    tp_rank: int = 0  # whose shard this is
    tp_ranks: list[DrafterState] = field(default_factory=list)  # under TP > 1: every TP rank's own state

    def report(self) -> dict:
        """The report's view: each tensor's record, and where each tensor came from."""
        return {
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
            "provenance": self.provenance.labels(),
        }


def combine_states(states: list[DrafterState]) -> DrafterState:
    """One state for the drafter's stage: TP rank 0's, with every rank's own (each shard measured on its rank)."""
    if len(states) == 1:
        return states[0]
    first = states[0]
    unfilled = sorted({name for state in states for name in state.unfilled})
    return DrafterState(first.provenance, unfilled, first.tensors, first.placeholders, 0, states)


def tensor_stats(tensor: torch.Tensor) -> TensorRecord:
    """NaN/Inf counts, zero fraction, and moments of the finite values (one pass through the kernels);
    duplicate rows for matrices, from per-row fingerprints. A matrix of more than STATS_ROWS rows (a real
    vocabulary's table: 129,280 x 7,168) is measured on STATS_ROWS rows spread evenly over it."""
    numel, sampled = tensor.numel(), tensor.dim() == 2 and tensor.shape[0] > STATS_ROWS
    if sampled:
        tensor = tensor.detach()[torch.linspace(0, tensor.shape[0] - 1, STATS_ROWS, device=tensor.device).long()]
    raw = chunked_stats(tensor)
    finite = tensor.numel() - raw["nan"] - raw["posinf"] - raw["neginf"]  # of the values measured
    mean = raw["sum"] / finite if finite else float("nan")
    variance = (raw["sumsq"] / finite - mean * mean) * finite / (finite - 1) if finite > 1 else float("nan")
    stats = TensorRecord(
        numel,
        nan=raw["nan"],
        inf=raw["posinf"] + raw["neginf"],
        zero_fraction=raw["zeros"] / tensor.numel() if tensor.numel() else 0.0,
        mean=mean,
        std=math.sqrt(max(variance, 0.0)) if finite > 1 else float("nan"),
        absmax=raw["absmax"] if finite else float("nan"),
    )
    if tensor.dim() == 2 and tensor.shape[0] > 1:
        # Equal rows (e.g. an all-zero table) share a fingerprint: a projection on a fixed random direction.
        projection = torch.randn(tensor.shape[1], generator=torch.Generator().manual_seed(0)).to(tensor.device)
        step, rows = max(1, CHUNK_ELEMENTS // tensor.shape[1]), torch.arange(len(tensor), device=tensor.device)
        chunks = [rows[start : start + step] for start in range(0, len(tensor), step)]
        fingerprints = torch.cat([kernels.row_fingerprints(tensor.detach(), chunk, projection)[1] for chunk in chunks])
        stats.duplicate_row_fraction = 1.0 - fingerprints.unique().numel() / tensor.shape[0]
    if sampled:
        stats.sampled_rows = STATS_ROWS
    return stats


def chunked_stats(tensor: torch.Tensor) -> dict[str, float]:
    """The kernels' raw statistics of the whole tensor, CHUNK_ELEMENTS at a time."""
    flat = tensor.detach().reshape(-1)
    total: dict[str, float] | None = None
    for start in range(0, max(flat.numel(), 1), CHUNK_ELEMENTS):
        raw = kernels.tensor_stats(flat[start : start + CHUNK_ELEMENTS])
        if total is None:
            total = raw
            continue
        total = {key: total[key] + raw[key] for key in ADDED} | {
            "min": min(total["min"], raw["min"]),
            "max": max(total["max"], raw["max"]),
            "absmax": max(total["absmax"], raw["absmax"]),
        }
    return total


def fingerprint_mismatch(
    checkpoint: Checkpoint, key: str, loaded: torch.Tensor, shard: tuple[int, int, int] | None = None
) -> tuple[int, int]:
    """(mismatching, compared) rows between the loaded tensor and rows read from the checkpoint (the caller
    compares shapes first). `shard`: the (dim, start, end) of the checkpoint tensor a TP rank's slice holds
    (sharding.shard_range); a vocabulary slice's rows past `end` are padding, expected zero."""
    dim, start, end = shard or (0, 0, checkpoint.tensors[key].shape[0])
    if loaded.dim() == 1:
        expected = checkpoint.read(key)[start:end].to(loaded.dtype)
        return int(not torch.equal(loaded.detach().cpu(), expected)), 1
    count = loaded.shape[0]
    rows = sorted({int(r) for r in torch.linspace(0, count - 1, min(SAMPLED_ROWS, count))})
    mismatches = 0
    for row in rows:
        if dim == 1:
            expected = checkpoint.read(key, rows=(row, row + 1))[:, start:end]
        elif start + row < end:
            expected = checkpoint.read(key, rows=(start + row, start + row + 1))
        else:
            expected = torch.zeros(1, *loaded.shape[1:])  # padding
        mismatches += int(not torch.equal(loaded[row : row + 1].detach().cpu(), expected.to(loaded.dtype)))
    return mismatches, len(rows)


def measure_drafter(model) -> DrafterState:
    """Measure the live drafter of a RankModel on the last rank: every tensor against the checkpoint."""
    device = model.device
    tp = tensor_parallel.current()
    provenance = Provenance(dict(model.provenance.sources))  # as it is now: a repair changes the model's
    state = DrafterState(provenance, model.provenance.unfilled(), tp_rank=tp.rank)
    kind = model.kind
    for name in kind.tensor_names():
        module_name, _, leaf = name.rpartition(".")  # a tensor of the drafter itself (EAGLE-3's d2t) has no module
        module = model.drafter.get_submodule(module_name)
        if leaf == "weight" and not has_real_weight(module):
            output = module(torch.arange(3, device=device)[None])
            echoed = isinstance(output, torch.Tensor) and not output.is_floating_point()
            state.placeholders[name] = Placeholder(type(module).__name__, echoed)
            continue
        tensor = getattr(module, leaf)
        measured = module_name.endswith(kind.stats_parts) and tensor.is_floating_point()
        stats = tensor_stats(tensor) if measured else TensorRecord(tensor.numel())
        source = kind.expected_source(name)
        if source is not None:
            checkpoint, key = source
            stats.checkpoint_key = key
            expected = tuple(checkpoint.tensors[key].shape)
            shard = shard_range(expected, tuple(tensor.shape), is_vocab_parallel(module), tp)
            if tuple(tensor.shape) != expected and shard is None:  # another tensor in its place (another vocabulary)
                stats.shape, stats.checkpoint_shape = list(tensor.shape), list(expected)
            else:
                stats.mismatched_rows, stats.compared_rows = fingerprint_mismatch(checkpoint, key, tensor, shard)
        state.tensors[name] = stats
    return state
