"""The layers that split over the tensor-parallel group as vLLM's do: the vocabulary-parallel embedding and head
(this rank's rows of the padded vocabulary) and the row-parallel projection (summed over the ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdoctor.runtime.models.packed import PackedLinear
from specdoctor.runtime.sharding import held_rows
from specdoctor.runtime.tensor_parallel import all_gather, all_reduce, current


class VocabParallelEmbedding(nn.Embedding):
    """vLLM's VocabParallelEmbedding: this rank's rows of the padded vocabulary; an id outside them looks up
    zeros, and the all-reduce adds the one rank that holds it. At TP 1 a plain embedding."""

    def __init__(self, vocab_size: int, hidden: int):
        start, end = held_rows(vocab_size, current())
        super().__init__(end - start, hidden)
        self.vocab_size, self.vocab_start = vocab_size, start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if current().size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        found = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(found.masked_fill(outside[..., None], 0))


class ParallelLMHead(nn.Linear):
    """vLLM's ParallelLMHead: this rank's rows of the padded vocabulary; the logits of every rank gathered, the
    padding cut off. At TP 1 a plain linear."""

    def __init__(self, hidden: int, vocab_size: int):
        start, end = held_rows(vocab_size, current())
        super().__init__(hidden, end - start, bias=False)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if current().size == 1:
            return super().forward(x)
        return all_gather(super().forward(x))[..., : self.vocab_size]


def is_vocab_parallel(module: nn.Module) -> bool:
    return isinstance(module, VocabParallelEmbedding | ParallelLMHead)


def row_parallel(linear: nn.Module, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
    """A row-parallel projection (o_proj, down_proj): this rank's input columns, summed over the ranks; the bias
    once, on rank 0, as vLLM's RowParallelLinear adds it. `reduce=False`: the caller sums (an MoE block)."""
    tp = current()
    if tp.size == 1:
        return linear(x)
    packed = isinstance(linear, PackedLinear)  # quantised words: its GEMM, the bias apart
    out = linear.matmul(x) if packed else F.linear(x, linear.weight)
    if tp.rank == 0 and linear.bias is not None:
        out = out + linear.bias
    return all_reduce(out) if reduce else out
