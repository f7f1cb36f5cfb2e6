"""Pipeline layer partition and placement, with vLLM's semantics (docs/engine-semantics.md §Partition,
§Ownership)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.architectures import ARCHITECTURES
from specdoctor.runtime.config import ModelConfig

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def default_partition(num_layers: int, pp: int) -> list[int]:
    """Even split; the remainder goes one layer each to ranks -2, -3, ... (never the last rank)."""
    parts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        parts[-(i + 2)] += 1
    return parts


def parse_partition(spec: str, num_layers: int, pp: int) -> list[int]:
    """An explicit partition such as '14,12,12,7': one entry per rank, summing to num_layers. A rank
    may own no layers, as in vLLM; an empty string is an error there too."""
    try:
        parts = [int(item) for item in spec.split(",")]
    except ValueError:
        raise SpecdoctorError(f"layer partition {spec!r} is not a comma-separated list of integers") from None
    if len(parts) != pp:
        raise SpecdoctorError(f"layer partition {spec!r} has {len(parts)} entries but the pipeline has {pp} ranks")
    if sum(parts) != num_layers:
        raise SpecdoctorError(f"layer partition {spec!r} sums to {sum(parts)}, the model has {num_layers} layers")
    if min(parts) < 0:  # vLLM would build an empty, backwards layer range; refuse it
        raise SpecdoctorError(f"layer partition {spec!r} gives a rank a negative number of layers")
    return parts


def layer_ranges(num_layers: int, pp: int, spec: str | None = None) -> list[range]:
    """Each rank's target layers; `spec` wins over the VLLM_PP_LAYER_PARTITION variable (set but empty
    is an error, as in vLLM). More ranks than layers leaves the last ranks without layers, as in vLLM."""
    if pp < 1:
        raise SpecdoctorError(f"--pp must be at least 1, got {pp}")
    spec = spec if spec is not None else os.environ.get(PARTITION_ENV)
    parts = parse_partition(spec, num_layers, pp) if spec is not None else default_partition(num_layers, pp)
    starts = [sum(parts[:i]) for i in range(pp)]
    return [range(start, start + size) for start, size in zip(starts, parts, strict=True)]


@dataclass(frozen=True)
class Placement:
    """What one pipeline rank owns."""

    rank: int
    world_size: int
    layers: range
    has_embedding: bool  # rank 0, and the last rank too when tied in a family that builds it there
    has_head: bool  # final norm + lm_head: the last rank
    has_drafter: bool  # the drafter (MTP layers, or a drafter checkpoint's module): the last rank

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1


def placements(config: ModelConfig, pp: int, spec: str | None = None, has_drafter: bool = False) -> list[Placement]:
    """`has_drafter`: the pipeline runs a drafter (of any kind: all of them live on the last rank)."""
    ranges = layer_ranges(config.num_hidden_layers, pp, spec)
    last = pp - 1
    tied_on_last = config.tie_word_embeddings and ARCHITECTURES[config.architecture].tied_embedding_on_last_rank
    return [
        Placement(
            rank=rank,
            world_size=pp,
            layers=layers,
            has_embedding=rank == 0 or (rank == last and tied_on_last),
            has_head=rank == last,
            has_drafter=rank == last and has_drafter,
        )
        for rank, layers in enumerate(ranges)
    ]
