"""How the drafter's embedding and head get their weights: correctly, or the ways engines got it wrong.

Embedding policies:
  fixed             alias the target's embedding only when it is materialised on this rank;
                    otherwise read it from the target checkpoint (first candidate key), narrowed
                    to a tensor-parallel rank's vocab range (padded rows zeroed) where TP applies.
  engine-legacy     share only when PP size is 1; the MTP loader keeps only keys under the spec
                    layer prefix, so at PP > 1 the embedding is left as allocated unless the
                    checkpoint ships the MTP layer's own copy.
  alias-placeholder share without checking: at PP > 1 the drafter aliases a PPMissingLayer.
Head policies (`shared_head.head`): fixed (checkpoint key, else the target's head), engine-legacy
(spec-prefix key only, else left as allocated), unloaded (left as allocated even if present).
What "left as allocated" holds is the fill: empty, zeros, nan, or stale (another weight's bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.loader import (
    allocate,
    drafter_layer_key,
    embedding_candidates,
    load_module,
    target_embedding_key,
)
from specdoctor.runtime.model import TargetStage
from specdoctor.runtime.mtp import MtpDrafter

EMBEDDING_POLICIES = ("fixed", "engine-legacy", "alias-placeholder")
HEAD_POLICIES = ("fixed", "engine-legacy", "unloaded")
FILLS = ("empty", "zeros", "nan", "stale")
VOCAB_PADDING = 64  # vLLM pads the vocabulary to a multiple of 64 before splitting it across TP ranks


@dataclass(frozen=True)
class DrafterPolicy:
    embedding: str = "fixed"
    head: str = "fixed"
    fill: str = "empty"

    def __post_init__(self):
        for value, allowed, what in (
            (self.embedding, EMBEDDING_POLICIES, "drafter policy"),
            (self.head, HEAD_POLICIES, "head policy"),
            (self.fill, FILLS, "fill"),
        ):
            if value not in allowed:
                raise SpecdoctorError(f"unknown {what} {value!r} (choose from {', '.join(allowed)})")


@dataclass
class Provenance:
    """Where each drafter tensor came from: 'checkpoint:KEY', 'alias:MODULE', 'placeholder:MODULE'
    or 'unfilled:FILL'. Anything unfilled is what the checks report."""

    sources: dict[str, str] = field(default_factory=dict)

    def unfilled(self) -> list[str]:
        return [name for name, source in self.sources.items() if source.startswith(("unfilled", "placeholder"))]


def has_real_weight(module: nn.Module | None) -> bool:
    """Materialised on this rank: a module with a real `.weight` (a PPMissingLayer has none)."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.device.type != "meta"


def vocab_shard_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """Rows [start, end) of the padded vocabulary that a tensor-parallel rank holds."""
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    per_rank = -(-padded // tp_size)
    return tp_rank * per_rank, (tp_rank + 1) * per_rank


def read_vocab_shard(checkpoint: Checkpoint, key: str, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's rows of an embedding-like tensor; rows past the real vocabulary are zero.
    (The runtime itself runs TP = 1; the checks use this to verify one shard's slice.)"""
    vocab, hidden = checkpoint.tensors[key].shape
    start, end = vocab_shard_range(vocab, tp_size, tp_rank)
    real = checkpoint.read(key, rows=(min(start, vocab), min(end, vocab)))
    if real.shape[0] == end - start:
        return real  # no padding rows: the read is the shard, with no second copy of a large table
    shard = torch.zeros(end - start, hidden, dtype=real.dtype)
    shard[: real.shape[0]] = real
    return shard


def fill_unloaded(parameter: torch.Tensor, fill: str, stale_source: torch.Tensor | None) -> None:
    """Give an unloaded parameter what an engine's allocation would hold."""
    with torch.no_grad():
        if fill == "zeros":
            parameter.zero_()
        elif fill == "nan":
            parameter.fill_(float("nan"))
        elif fill == "stale" and stale_source is not None:
            # A caching allocator hands back a freed block of the same size: here, another weight's bytes.
            parameter.copy_(stale_source.reshape(parameter.shape))
        # "empty": leave the bytes torch.empty gave.


def build_drafter(
    checkpoint: Checkpoint,
    target: TargetStage,
    world_size: int,
    policy: DrafterPolicy,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[MtpDrafter, Provenance]:
    drafter = allocate(lambda: MtpDrafter(checkpoint.config), dtype, device)
    provenance = Provenance()
    body = load_module(drafter, checkpoint, lambda n: None if _is_head(n) else drafter_layer_key(n))
    provenance.sources.update({name: f"checkpoint:{drafter_layer_key(name)}" for name in body.filled})
    provenance.sources.update({name: "unfilled:missing-from-checkpoint" for name in body.missing})
    _place_embedding(drafter, checkpoint, target, world_size, policy, provenance)
    _place_heads(drafter, checkpoint, target, policy, provenance)
    return drafter.eval(), provenance


def _is_head(name: str) -> bool:
    return name.endswith("shared_head.head.weight")


def _place_embedding(drafter, checkpoint, target, world_size, policy, provenance) -> None:
    name = "embed_tokens.weight"
    own_copies = [f"model.layers.{i}.embed_tokens.weight" for i in checkpoint.config.mtp_layer_ids]
    if policy.embedding == "alias-placeholder" or (policy.embedding == "engine-legacy" and world_size == 1):
        drafter.embed_tokens = target.model.embed_tokens
        real = has_real_weight(target.model.embed_tokens)
        provenance.sources[name] = "alias:model.embed_tokens" if real else "placeholder:model.embed_tokens"
        return
    if policy.embedding == "fixed" and has_real_weight(target.model.embed_tokens):
        drafter.embed_tokens = target.model.embed_tokens
        provenance.sources[name] = "alias:model.embed_tokens"
        return
    if policy.embedding == "fixed":
        key = checkpoint.first_present(embedding_candidates(checkpoint.config))
    else:  # engine-legacy at PP > 1: only the MTP layer's own copy is under the spec prefix
        key = checkpoint.first_present(own_copies)
    if key is None:
        stale = target.lm_head.weight if has_real_weight(target.lm_head) else None
        fill_unloaded(drafter.embed_tokens.weight, policy.fill, stale)
        provenance.sources[name] = f"unfilled:{policy.fill}"
        return
    load_module(drafter.embed_tokens, checkpoint, lambda _n: key)
    provenance.sources[name] = f"checkpoint:{key}"


def _place_heads(drafter, checkpoint, target, policy, provenance) -> None:
    for layer_id, layer in drafter.layers.items():
        name = f"layers.{layer_id}.shared_head.head.weight"
        key = drafter_layer_key(name)
        head = layer.shared_head.head
        if policy.head != "unloaded" and key in checkpoint.tensors:
            load_module(head, checkpoint, lambda _n, key=key: key)
            provenance.sources[name] = f"checkpoint:{key}"
        elif policy.head == "fixed" and has_real_weight(target.lm_head):
            layer.shared_head.head = target.lm_head
            provenance.sources[name] = "alias:lm_head"
        elif policy.head == "fixed":
            fallback = "lm_head.weight" if "lm_head.weight" in checkpoint.tensors else target_embedding_key(checkpoint)
            load_module(head, checkpoint, lambda _n, key=fallback: key)
            provenance.sources[name] = f"checkpoint:{fallback}"
        else:
            stale = drafter.embed_tokens.weight if has_real_weight(drafter.embed_tokens) else None
            fill_unloaded(head.weight, policy.fill, stale)
            provenance.sources[name] = f"unfilled:{policy.fill}"
