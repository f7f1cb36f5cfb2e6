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
            if target.is_meta:  # allocated lazily: the tensor gets its storage now, a map of its shard where it can
                mapped = checkpoint.mapped(key, target.dtype) if checkpoint.map_weights else None
                replace_tensor(module, name, checkpoint.read(key).to(target.dtype) if mapped is None else mapped)
            else:
                checkpoint.read(key, out=target)
        result.filled.add(name)
    return result


def replace_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Put `value` in place of the parameter or buffer `name` (its storage too, not only its values)."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def allocate(
    factory: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device | str, lazy: bool = False
) -> nn.Module:
    """Build a module without initialising it: every tensor is fresh `torch.empty` storage. `lazy` (a checkpoint
    whose tensors are mapped: runtime/memory.py): the module stays on the meta device, `load_module` gives each
    tensor it loads its storage and `materialize` the rest; such a module is measured and repaired, not run
    (its fused weights are not joined)."""
    with torch.device("meta"):
        module = factory()
    return module.to(dtype) if lazy else module.to_empty(device=device).to(dtype)


def materialize(module: nn.Module, device: torch.device | str) -> None:
    """Fresh `torch.empty` storage for every tensor of a lazily allocated module that nothing loaded."""
    for owner in module.modules():
        for tensors in (owner._parameters, owner._buffers):
            for name, tensor in tensors.items():
                if tensor is not None and tensor.is_meta:
                    empty = torch.empty_like(tensor, device=device)
                    tensors[name] = nn.Parameter(empty, requires_grad=False) if tensors is owner._parameters else empty


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
    stage = allocate(
        lambda: TargetStage(config, layers, has_embedding, has_head), dtype, device, checkpoint.map_weights
    )
    result = load_module(stage, checkpoint, target_key_for(checkpoint))
    materialize(stage, device)
    if result.missing:
        name, key = next(iter(result.missing.items()))
        more = f" (and {len(result.missing) - 1} more)" if len(result.missing) > 1 else ""
        raise CheckpointError(f"{checkpoint.path}: target tensor {key!r} is missing from the checkpoint{more}")
    return stage.eval()


def load_full_target(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32) -> TargetStage:
    """The whole target in one stage (PP = 1): embedding, every layer, final norm and head."""
    return load_target_stage(checkpoint, range(checkpoint.config.num_hidden_layers), True, True, dtype)
