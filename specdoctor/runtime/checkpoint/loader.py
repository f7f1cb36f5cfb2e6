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
from specdoctor.runtime.checkpoint.keys import target_key_for
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.models.stage import TargetStage


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
    result = load_module(stage, checkpoint, target_key_for(checkpoint))
    if result.missing:
        name, key = next(iter(result.missing.items()))
        more = f" (and {len(result.missing) - 1} more)" if len(result.missing) > 1 else ""
        raise CheckpointError(f"{checkpoint.path}: target tensor {key!r} is missing from the checkpoint{more}")
    return stage.eval()


def load_full_target(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32) -> TargetStage:
    """The whole target in one stage (PP = 1): embedding, every layer, final norm and head."""
    return load_target_stage(checkpoint, range(checkpoint.config.num_hidden_layers), True, True, dtype)
