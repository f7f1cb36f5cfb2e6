"""The repair: fill broken drafter tensors from the target checkpoint, one tensor read each, never
writing to the checkpoint (docs/engine-semantics.md §Drafter embedding and head under PP).

Under tensor parallelism an engine's embedding holds its rank's rows of the vocabulary padded to a
multiple of 64, with the padded rows zero (vLLM's VocabParallelEmbedding, which refuses a padded
vocabulary that does not split evenly); `check_vocab_shard` verifies one TP rank's slice of the
repaired parameter against the checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint.loader import load_module
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.kind import EMBEDDING

VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it across TP ranks


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
    tp_shard: TpShardCheck | None = None


def vocab_shard_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Rows [start, end) of the padded vocabulary that a tensor-parallel rank holds."""
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    if padded % tp_size:
        raise SpecdoctorError(
            f"a vocabulary of {vocab_size} rows ({padded} padded to a multiple of {VOCAB_PADDING}) does not split "
            f"over {tp_size} tensor-parallel ranks; vLLM refuses it too"
        )
    per_rank = padded // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


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


def check_vocab_shard(
    checkpoint: Checkpoint, key: str, repaired: torch.Tensor, tp_size: int, tp_rank: int
) -> TpShardCheck:
    """Does TP rank `tp_rank`'s slice of the repaired parameter [V, H] hold the checkpoint's rows for that
    rank, and would the rank's padded rows be zero, as an engine's VocabParallelEmbedding loads them?"""
    start, end = vocab_shard_range(repaired.shape[0], tp_size, tp_rank)
    shard = read_vocab_shard(checkpoint, key, tp_size, tp_rank)  # the rank's rows, padding zeroed
    real = max(0, min(end, repaired.shape[0]) - start)
    rows = repaired[start : start + real].detach().cpu()
    return TpShardCheck(
        tp_size,
        tp_rank,
        [start, end],
        real,
        shard.shape[0] - real,
        bool(torch.equal(rows, shard[:real].to(rows.dtype))),
        bool((shard[real:] == 0).all()),
    )


def repair_drafter(model, names: list[str], tp_size: int = 1, tp_rank: int = 0) -> RepairResult:
    """Fill the named drafter tensors of a RankModel from the checkpoint that holds them (the target's, or a
    drafter checkpoint of its own), one tensor read each."""
    drafter, device, dtype = model.drafter, model.device, model.dtype
    checkpoints = model.kind.checkpoints
    before, start = sum(c.bytes_read for c in checkpoints), time.perf_counter()
    result = RepairResult()
    for name in names:
        source = model.kind.expected_source(name)
        if source is None:
            continue
        checkpoint, key = source
        if name == EMBEDDING:
            # The runtime computes with the whole vocabulary: TP rank 0 of 1 is the whole padded table.
            table = read_vocab_shard(checkpoint, key, 1, 0)[: model.checkpoint.config.vocab_size]
            drafter.embed_tokens = nn.Embedding.from_pretrained(table.to(device, dtype), freeze=True)
            if tp_size > 1:
                result.tp_shard = check_vocab_shard(checkpoint, key, drafter.embed_tokens.weight, tp_size, tp_rank)
        else:
            owner, _, leaf = name.rpartition(".")
            if model.provenance.sources.get(name, "").startswith("alias:"):  # never write into the target's tensor
                rows, columns = checkpoint.tensors[key].shape
                drafter.set_submodule(owner, nn.Linear(columns, rows, bias=False, device=device, dtype=dtype))
            load_module(
                drafter.get_submodule(owner), checkpoint, lambda part, leaf=leaf, key=key: key if part == leaf else None
            )
        model.provenance.sources[name] = f"checkpoint:{key}"
        result.repaired[name] = key
    result.bytes_read = sum(c.bytes_read for c in checkpoints) - before
    result.seconds = round(time.perf_counter() - start, 4)
    return result
