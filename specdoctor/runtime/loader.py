"""Builds stages with uninitialised storage (as engines do) and fills them from a checkpoint.

Loaders return the names they filled; whatever is left unfilled keeps the bytes `torch.empty`
gave it, which is exactly the state the checks look for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from specdoctor.errors import CheckpointError
from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.model import TargetStage
from specdoctor.runtime.mtp import MtpDrafter

EMBEDDING_KEY = "model.embed_tokens.weight"


def embedding_candidates(config) -> list[str]:
    """Checkpoint keys that can supply the drafter's token embedding, in order of preference."""
    keys = [
        "model.language_model.embed_tokens.weight",
        EMBEDDING_KEY,
        "model.embed.weight",
        "embed_tokens.weight",
        "model.word_embeddings.weight",
        "tok_embeddings.weight",
        "transformer.wte.weight",
    ]
    return keys + [f"model.layers.{i}.embed_tokens.weight" for i in config.mtp_layer_ids]


@dataclass
class LoadResult:
    filled: set[str] = field(default_factory=set)
    missing: dict[str, str] = field(default_factory=dict)  # parameter name -> checkpoint key not found


def load_module(module: nn.Module, checkpoint: Checkpoint, key_for: Callable[[str], str | None]) -> LoadResult:
    """Copy each parameter/persistent buffer from the checkpoint key `key_for(name)`; None skips it."""
    result = LoadResult()
    for name, target in module.state_dict(keep_vars=True).items():
        key = key_for(name)
        if key is None:
            continue
        if key not in checkpoint.tensors:
            result.missing[name] = key
            continue
        shape = checkpoint.tensors[key].shape
        if tuple(shape) != tuple(target.shape):
            raise CheckpointError(
                f"{checkpoint.path}: tensor {key!r} has shape {tuple(shape)}, the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            checkpoint.read(key, out=target)
        result.filled.add(name)
    return result


def allocate(factory: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Build a module without initialising it: every tensor is fresh `torch.empty` storage."""
    with torch.device("meta"):
        module = factory()
    return module.to_empty(device=device).to(dtype)


def target_embedding_key(checkpoint: Checkpoint) -> str:
    """The target's embedding key: the first candidate present (MTP layers' own copies excluded)."""
    candidates = embedding_candidates(checkpoint.config)[: -checkpoint.config.num_nextn_predict_layers or None]
    return checkpoint.first_present(candidates) or EMBEDDING_KEY


def target_key(checkpoint: Checkpoint) -> Callable[[str], str]:
    embedding = target_embedding_key(checkpoint)
    tied = checkpoint.config.tie_word_embeddings

    def key_for(name: str) -> str:
        if name == EMBEDDING_KEY or (tied and name == "lm_head.weight"):
            return embedding
        return name

    return key_for


def load_target_stage(
    checkpoint: Checkpoint,
    layers: range,
    has_embedding: bool,
    has_head: bool,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> TargetStage:
    """A target stage with every owned tensor read from the checkpoint; a missing one is an error."""
    config = checkpoint.config
    stage = allocate(lambda: TargetStage(config, layers, has_embedding, has_head), dtype, device)
    result = load_module(stage, checkpoint, target_key(checkpoint))
    if result.missing:
        name, key = next(iter(result.missing.items()))
        more = f" (and {len(result.missing) - 1} more)" if len(result.missing) > 1 else ""
        raise CheckpointError(f"{checkpoint.path}: target tensor {key!r} is missing from the checkpoint{more}")
    return stage.eval()


def drafter_layer_key(name: str) -> str | None:
    """Checkpoint key of a drafter parameter under the spec-layer prefix; None for the embedding."""
    return f"model.{name}" if name.startswith("layers.") else None


def load_drafter(
    checkpoint: Checkpoint, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[MtpDrafter, LoadResult]:
    """The MTP drafter with its layers loaded and its embedding read from the first candidate key."""
    drafter = allocate(lambda: MtpDrafter(checkpoint.config), dtype, device)
    result = load_module(drafter, checkpoint, drafter_layer_key)
    embedding = checkpoint.first_present(embedding_candidates(checkpoint.config))
    if embedding is None:
        result.missing["embed_tokens.weight"] = " | ".join(embedding_candidates(checkpoint.config))
    else:
        result.filled |= load_module(
            drafter, checkpoint, lambda n: embedding if n == "embed_tokens.weight" else None
        ).filled
    return drafter.eval(), result
