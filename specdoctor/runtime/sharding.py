"""What a tensor-parallel rank holds, as vLLM 0.32 shards a model (docs/tensor-parallel.md): its rows of the padded
vocabulary, its slice of each checkpoint tensor (for loading and measuring it) and its config (heads and
intermediate sizes divided by the TP size)."""

from __future__ import annotations

import dataclasses

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.tensor_parallel import TensorParallel

VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it across TP ranks


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING


def vocab_shard_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Rows [start, end) of the padded vocabulary that a tensor-parallel rank holds (vLLM's
    `vocab_range_from_global_vocab_size` over `pad_vocab_size`)."""
    padded = padded_vocab(vocab_size)
    if padded % tp_size:
        raise SpecdoctorError(
            f"a vocabulary of {vocab_size} rows ({padded} padded to a multiple of {VOCAB_PADDING}) does not split "
            f"over {tp_size} tensor-parallel ranks (vLLM: '{padded} is not divisible by {tp_size}')"
        )
    per_rank = padded // tp_size
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def held_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """The vocabulary rows a rank's module holds: its padded shard, or at TP 1 the vocabulary unpadded (the padding
    is all zero logits, which sampling would have to cut again)."""
    return (0, vocab_size) if tp.size == 1 else vocab_shard_range(vocab_size, tp.size, tp.rank)


# Config fields a rank holds 1/TP of: heads (linear attention's too, Gated DeltaNet's) and intermediate sizes.
SPLIT_FIELDS = (
    "num_attention_heads",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
)


def local_config(config, size: int):
    """The config of one rank's slice: attention heads, KV heads (one each where fewer than ranks: replicated),
    and the dense and expert intermediate sizes divided by `size` (a config that runtime/refusals.py refuses is
    not split)."""
    if size == 1:
        return config
    split = {name: getattr(config, name) // size for name in SPLIT_FIELDS if hasattr(config, name)}
    return dataclasses.replace(config, **split, num_key_value_heads=max(1, config.num_key_value_heads // size))


def segment_ranges(segments: tuple[int, ...], tp: TensorParallel) -> list[tuple[int, int]]:
    """Rows a rank holds of a tensor whose rows are `segments` laid end to end (Gated DeltaNet's q | k | v
    channels), each split evenly: its slice of every segment, as vLLM's merged column-parallel loaders cut them."""
    ranges, start = [], 0
    for size in segments:
        part = size // tp.size
        ranges.append((start + tp.rank * part, start + (tp.rank + 1) * part))
        start += size
    return ranges


def shard_range(full: tuple[int, ...], local: tuple[int, ...], vocab: bool, tp: TensorParallel):
    """(dim, start, end) of the checkpoint tensor of shape `full` that this rank's parameter of shape `local`
    holds, or None when it holds all of it. A vocabulary's rows may end before the shard does (the padding);
    a slice narrower than its share of `full` is a replicated KV head (ranks r*n/N..: the same head)."""
    if tuple(full) == tuple(local):
        return None
    if vocab:
        start, end = vocab_shard_range(full[0], tp.size, tp.rank)
        held = local[0] == end - start and tuple(full[1:]) == tuple(local[1:])
        return (0, min(start, full[0]), min(end, full[0])) if held else None  # else another vocabulary's slice
    differing = [dim for dim, (a, b) in enumerate(zip(full, local, strict=True)) if a != b]
    if len(full) != len(local) or len(differing) != 1:
        return None
    dim = differing[0]
    whole, part = full[dim], local[dim]
    if part * tp.size == whole:
        return dim, tp.rank * part, (tp.rank + 1) * part
    if (part * tp.size) % whole == 0 and whole % part == 0:  # replicated: size / (whole / part) ranks per slice
        block = tp.rank // (part * tp.size // whole)
        return dim, block * part, (block + 1) * part
    return None
