"""The repair: fill broken drafter tensors from the target checkpoint, one tensor read each, never
writing to the checkpoint (docs/engine-semantics.md §Drafter embedding and head under PP).

Under tensor parallelism each TP rank repairs its own slice: its rows of the vocabulary padded to a multiple of
64, the padded rows zero (vLLM's VocabParallelEmbedding); `check_vocab_shard` verifies the slice against the
checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.checkpoint.loader import allocate, load_module
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.kind import EMBEDDING
from specdoctor.runtime.drafter.policy import Origin, TensorSource
from specdoctor.runtime.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding
from specdoctor.runtime.sharding import vocab_shard_range
from specdoctor.runtime.tensor_parallel import TensorParallel


@dataclass
class TpShardCheck:
    tp_size: int
    tp_rank: int
    rows: list[int]  # [start, end) of the padded vocabulary
    real_rows: int
    padded_rows: int
    matches_table: bool
    padding_zero: bool

    @property
    def ok(self) -> bool:
        return self.matches_table and self.padding_zero


@dataclass
class RepairResult:
    repaired: dict[str, str] = field(default_factory=dict)  # drafter tensor -> checkpoint key it was read from
    bytes_read: int = 0
    seconds: float = 0.0
    tp_shard: TpShardCheck | None = None  # under TP > 1, this rank's repaired vocabulary slice checked
    tp_rank: int = 0
    tp_ranks: list[RepairResult] = field(default_factory=list)  # under TP > 1: every TP rank's own result


def read_vocab_shard(checkpoint: Checkpoint, key: str, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's rows of an embedding-like tensor; rows past the real vocabulary are zero."""
    vocab, hidden = checkpoint.tensors[key].shape
    start, end = vocab_shard_range(vocab, tp_size, tp_rank)
    real = checkpoint.read(key, rows=(min(start, vocab), min(end, vocab)))
    if real.shape[0] == end - start:
        return real  # no padding rows: the read is the shard, with no second copy of a large table
    shard = torch.zeros(end - start, hidden, dtype=real.dtype)
    shard[: real.shape[0]] = real
    return shard


def check_vocab_shard(checkpoint: Checkpoint, key: str, local: torch.Tensor, tp: TensorParallel) -> TpShardCheck:
    """Does TP rank `tp.rank`'s repaired slice of the vocabulary hold the checkpoint's rows for the rank, and are
    its padded rows zero, as an engine's VocabParallelEmbedding loads them?"""
    start, end = vocab_shard_range(checkpoint.tensors[key].shape[0], tp.size, tp.rank)
    shard = read_vocab_shard(checkpoint, key, tp.size, tp.rank)  # the rank's rows, padding zeroed
    real = max(0, min(end, checkpoint.tensors[key].shape[0]) - start)
    rows = local.detach().cpu()
    return TpShardCheck(
        tp.size,
        tp.rank,
        [start, end],
        real,
        shard.shape[0] - real,
        bool(torch.equal(rows[:real], shard[:real].to(rows.dtype))),
        bool((rows[real:] == 0).all()),
    )


def repair_drafter(model, names: list[str] | dict[int, list[str]]) -> RepairResult:
    """Fill the named drafter tensors of a RankModel from the checkpoint that holds them (the target's, or a
    drafter checkpoint of its own), one tensor read each; under TP only this rank's rows of it. `names` by TP
    rank: each rank repairs its own (a shard found healthy is not read again)."""
    tp = tensor_parallel.current()
    names = names.get(tp.rank, []) if isinstance(names, dict) else names
    drafter, device, dtype = model.drafter, model.device, model.dtype
    checkpoints = model.kind.checkpoints
    before, start = sum(c.bytes_read for c in checkpoints), time.perf_counter()
    result = RepairResult(tp_rank=tp.rank)
    for name in names:
        source = model.kind.expected_source(name)
        if source is None:
            continue
        checkpoint, key = source
        owner, _, leaf = name.rpartition(".")
        placed = model.provenance.sources.get(name)
        if placed is not None and placed.origin in (Origin.ALIAS, Origin.PLACEHOLDER):
            # Never write into the target's tensor (nor into a placeholder): a module of the drafter's own.
            rows, columns = checkpoint.tensors[key].shape
            own = VocabParallelEmbedding(rows, columns) if name == EMBEDDING else ParallelLMHead(columns, rows)
            drafter.set_submodule(owner, allocate(lambda own=own: own, dtype, device))
        load_module(
            drafter.get_submodule(owner), checkpoint, lambda part, leaf=leaf, key=key: key if part == leaf else None
        )
        if name == EMBEDDING and tp.size > 1:
            result.tp_shard = check_vocab_shard(checkpoint, key, drafter.embed_tokens.weight, tp)
        model.provenance.sources[name] = TensorSource(Origin.CHECKPOINT, key)
        result.repaired[name] = key
    result.bytes_read = sum(c.bytes_read for c in checkpoints) - before
    result.seconds = round(time.perf_counter() - start, 4)
    return result


def combine_repairs(results: list[RepairResult]) -> RepairResult:
    """One result for the drafter's stage: what every TP rank repaired, with its own shard's check."""
    if len(results) == 1:
        return results[0]
    combined = RepairResult(seconds=max(result.seconds for result in results), tp_ranks=results)
    for result in results:
        combined.repaired.update({f"{name} (TP rank {result.tp_rank})": key for name, key in result.repaired.items()})
        combined.bytes_read += result.bytes_read
    return combined
