"""DeepSeek Sparse Attention checkpoints whose indexer really selects, and ties: `index_topk` below the test
contexts and two indexer heads, so a key scores exactly 0 whenever both heads' dot products are negative (a
quarter of the keys), and the top-k boundary often falls among those zeros."""

from __future__ import annotations

import contextlib

import torch

from specdoctor.runtime.checkpoint.loader import load_full_target
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.models.dsa import DsaIndexer
from tests.helpers.families import make_family_checkpoint

DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
TIED = dict(index_topk=6, index_n_heads=2, index_head_dim=32)


def make_tied_checkpoint(path, architecture: str, seed: int = 0, **overrides):
    """A tiny `architecture` checkpoint (transformers' classes, the hub layout) with TIED's indexer."""
    return make_family_checkpoint(path, architecture, seed, **{**TIED, **overrides})


@contextlib.contextmanager
def indexer_calls():
    """Record every DsaIndexer.select call as (indexer, its arguments, its scores [B, T, S] float64)."""
    calls, select, scores = [], DsaIndexer.select, DsaIndexer.scores

    def recording(self, *args):
        calls.append((self, args, scores(self, *args)))
        return select(self, *args)

    DsaIndexer.select = recording
    try:
        yield calls
    finally:
        DsaIndexer.select = select


def prompt_scores(stage, ids: torch.Tensor) -> list[tuple[DsaIndexer, tuple, torch.Tensor]]:
    """The indexer calls of one cache-less forward of `stage` (a whole target) over ids [B, T]."""
    with indexer_calls() as calls, torch.no_grad():
        stage(ids, torch.arange(ids.shape[1]).expand(ids.shape[0], -1))
    return calls


def whole_target(path):
    """The runtime's whole target (PP 1) of the checkpoint at `path`."""
    return load_full_target(Checkpoint(path))
