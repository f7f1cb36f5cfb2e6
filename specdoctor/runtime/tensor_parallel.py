"""Tensor parallelism as vLLM 0.32 shards a model (docs/tensor-parallel.md): each rank of a pipeline stage holds
its slice of every column-parallel projection (q/k/v, gate/up, MLA's q_b/kv_b, every expert's gate/up), of the
row-parallel ones (o_proj, down_proj, summed by an all-reduce) and of the vocabulary (embedding and heads padded
to a multiple of 64, then split); norms, routers and MLA's latent projections are replicated.

This module holds the group and its collectives: a rank process holds one group (`current()`, set once by its
PipelineComm); modules size themselves from it when built and reduce through it when run, as vLLM's layers read
its parallel state. What a rank holds is runtime/sharding.py's, the layers that split are
runtime/models/parallel_layers.py's, what is refused runtime/refusals.py's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdoctor.errors import PipelineError


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
