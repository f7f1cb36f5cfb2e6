"""Tensor parallelism as vLLM 0.32 shards a model (docs/tensor-parallel.md): each rank of a pipeline stage holds
its slice of every column-parallel projection (q/k/v, gate/up, MLA's q_b/kv_b, every expert's gate/up), of the
row-parallel ones (o_proj, down_proj, summed by an all-reduce) and of the vocabulary (embedding and heads padded
to a multiple of 64, then split); norms, routers and MLA's latent projections are replicated.

A rank process holds one group (`current()`, set once by its PipelineComm); modules size themselves from it when
built and reduce through it when run, as vLLM's layers read its parallel state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.models.packed import PackedLinear

VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it across TP ranks


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # the torch.distributed group of this rank's stage; None at size 1


_current = TensorParallel()


def current() -> TensorParallel:
    return _current


def use(tensor_parallel: TensorParallel) -> None:
    """This process's group from now on (a rank process sets it once, before building its modules)."""
    global _current
    _current = tensor_parallel


@contextlib.contextmanager
def collective(what: str):
    """A TP collective whose failure names the group (the pipeline's error, so the controller tells a peer's
    failure from this rank's own)."""
    try:
        yield
    except Exception as err:  # gloo and NCCL raise several types
        from specdoctor.runtime.comm import PipelineError  # comm imports this module

        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PipelineError(f"TP rank {_current.rank}: {what} with its TP group failed ({detail[:200]})") from None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of every TP rank's `x` (in place), in the model's dtype as vLLM reduces it."""
    tp = _current
    if tp.size > 1:
        with collective("an all-reduce"):
            dist.all_reduce(x, group=tp.group)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every TP rank's `x` joined along `dim`, in rank order."""
    tp = _current
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    with collective("an all-gather"):
        dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


@contextlib.contextmanager
def acting_as(tensor_parallel: TensorParallel):
    """Modules built inside take `tensor_parallel`'s shapes (a plan or a check made in another process)."""
    previous = current()
    use(tensor_parallel)
    try:
        yield
    finally:
        use(previous)


def held_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """The vocabulary rows a rank's module holds: its padded shard, or at TP 1 the vocabulary unpadded (the padding
    is all zero logits, which sampling would have to cut again)."""
    return (0, vocab_size) if tp.size == 1 else vocab_shard_range(vocab_size, tp.size, tp.rank)


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


class VocabParallelEmbedding(nn.Embedding):
    """vLLM's VocabParallelEmbedding: this rank's rows of the padded vocabulary; an id outside them looks up
    zeros, and the all-reduce adds the one rank that holds it. At TP 1 a plain embedding."""

    def __init__(self, vocab_size: int, hidden: int):
        start, end = held_rows(vocab_size, _current)
        super().__init__(end - start, hidden)
        self.vocab_size, self.vocab_start = vocab_size, start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if _current.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        found = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(found.masked_fill(outside[..., None], 0))


class ParallelLMHead(nn.Linear):
    """vLLM's ParallelLMHead: this rank's rows of the padded vocabulary; the logits of every rank gathered, the
    padding cut off. At TP 1 a plain linear."""

    def __init__(self, hidden: int, vocab_size: int):
        start, end = held_rows(vocab_size, _current)
        super().__init__(hidden, end - start, bias=False)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _current.size == 1:
            return super().forward(x)
        return all_gather(super().forward(x))[..., : self.vocab_size]


def is_vocab_parallel(module: nn.Module) -> bool:
    return isinstance(module, VocabParallelEmbedding | ParallelLMHead)


def row_parallel(linear: nn.Module, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
    """A row-parallel projection (o_proj, down_proj): this rank's input columns, summed over the ranks; the bias
    once, on rank 0, as vLLM's RowParallelLinear adds it. `reduce=False`: the caller sums (an MoE block)."""
    tp = _current
    if tp.size == 1:
        return linear(x)
    packed = isinstance(linear, PackedLinear)  # quantised words: its GEMM, the bias apart
    out = linear.matmul(x) if packed else F.linear(x, linear.weight)
    if tp.rank == 0 and linear.bias is not None:
        out = out + linear.bias
    return all_reduce(out) if reduce else out


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
    and the dense and expert intermediate sizes divided by `size` (a config refused by `refusal` is not split)."""
    if size == 1:
        return config
    split = {name: getattr(config, name) // size for name in SPLIT_FIELDS if hasattr(config, name)}
    return dataclasses.replace(config, **split, num_key_value_heads=max(1, config.num_key_value_heads // size))


def refusal(config, size: int) -> str | None:
    """Why vLLM 0.32 refuses this model at TP `size` (its own rule quoted), or None."""
    if size == 1:
        return None
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        return (
            f"Total number of attention heads ({heads}) must be divisible by tensor parallel size ({size}) "
            "(vLLM's rule)"
        )
    if kv_heads % size if kv_heads >= size else size % kv_heads:
        return f"{kv_heads} KV heads neither divide over nor replicate evenly across {size} ranks (vLLM's rule)"
    for name in SPLIT_FIELDS[1:]:
        value = getattr(config, name, 0)
        if value % size:
            return f"{name} {value} is not divisible by {size} (vLLM's rule for its column-parallel projections)"
    try:
        vocab_shard_range(config.vocab_size, size, 0)
    except SpecdoctorError as err:
        return str(err)
    return None


def runtime_refusal(checkpoint, drafter, options, local_ranks: int | None = None) -> str | None:
    """Why the runtime will not run this pair: at `options.tp` > 1 what vLLM or specdoctor will not shard, then
    more ranks on this machine than CUDA devices (NCCL refuses two ranks on one GPU). `local_ranks`: the ranks on
    this machine (torchrun's LOCAL_WORLD_SIZE; None: all of them, as specdoctor's own launcher starts them)."""
    return sharding_refusal(checkpoint, drafter, options) or device_refusal(options, local_ranks)


def device_refusal(options, local_ranks: int | None = None) -> str | None:
    if options.device.value != "cuda":
        return None
    local_ranks, devices = local_ranks or options.tp * options.pp, torch.cuda.device_count()
    if devices == 0:
        return "--device cuda: this machine has no CUDA device"
    if local_ranks > devices:
        return (
            f"--tp {options.tp} x --pp {options.pp} on --device cuda: {local_ranks} ranks on this machine need as "
            f"many CUDA devices (NCCL runs one rank per GPU), it has {devices}"
        )
    return None


def sharding_refusal(checkpoint, drafter, options) -> str | None:
    """Why the runtime will not run this pair at `options.tp` > 1: vLLM's own rules (`refusal`), then what
    specdoctor does not shard yet (refused, never approximated)."""
    size, config = options.tp, checkpoint.config
    if size == 1:
        return None
    reason = refusal(config, size)
    if reason is None and drafter is not None and drafter.checkpoint is not None:  # a drafter checkpoint of its own
        reason = drafter_refusal(drafter.checkpoint.config, size)
    if reason is None and any("g_idx" in weight.parts for weight in checkpoint.quantized.values()):
        reason = "the runtime does not shard activation-ordered groups (weight_g_idx) yet"
    if reason is None and checkpoint.quantized and options.quantized_weights.value == "packed":
        reason = packed_slice_refusal(checkpoint, options)
    return f"--tensor-parallel-size {size}: {reason}" if reason else None


def drafter_refusal(config, size: int) -> str | None:
    """vLLM's rules for a drafter checkpoint's layers (an EAGLE-3 or DSpark backbone, a draft model) and for its
    draft vocabulary, which its head splits as the target's."""
    reason = refusal(getattr(config, "backbone", config), size)
    draft_vocab = getattr(config, "draft_vocab_size", None)
    if reason is None and draft_vocab:
        try:
            vocab_shard_range(draft_vocab, size, 0)
        except SpecdoctorError as err:
            reason = f"its draft vocabulary: {err}"
    return f"the drafter: {reason}" if reason else None


def segment_ranges(segments: tuple[int, ...], tp: TensorParallel) -> list[tuple[int, int]]:
    """Rows a rank holds of a tensor whose rows are `segments` laid end to end (Gated DeltaNet's q | k | v
    channels), each split evenly: its slice of every segment, as vLLM's merged column-parallel loaders cut them."""
    ranges, start = [], 0
    for size in segments:
        part = size // tp.size
        ranges.append((start + tp.rank * part, start + (tp.rank + 1) * part))
        start += size
    return ranges


def packed_slice_refusal(checkpoint, options) -> str | None:
    """Whether every stage's packed weights slice into whole words, groups and blocks at TP `options.tp` (vLLM's
    kernels refuse a slice that does not: "Weight input_size_per_partition = N is not divisible by ..."): each
    stage built on the meta device, as a rank builds it, in TP rank 0's shapes."""
    from specdoctor.errors import CheckpointError
    from specdoctor.runtime.checkpoint.loader import build_stage
    from specdoctor.runtime.partition import placements

    try:
        with acting_as(TensorParallel(0, options.tp)), torch.device("meta"):
            for stage in placements(checkpoint.config, options.pp, options.pp_partition):
                build_stage(checkpoint, stage.layers, stage.has_embedding, stage.has_head, packed=True)
    except CheckpointError as err:
        return f"a rank's slice of a packed weight: {str(err).removeprefix(f'{checkpoint.path}: ')}"
    return None


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
