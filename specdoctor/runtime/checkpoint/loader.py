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
from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.checkpoint.files import TORCH_DTYPES
from specdoctor.runtime.checkpoint.keys import target_key_for
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.models.packed import PackedLinear, sliced_parts
from specdoctor.runtime.models.parallel_layers import is_vocab_parallel
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.quantization import check_weight_shape
from specdoctor.runtime.sharding import segment_ranges, shard_range
from specdoctor.runtime.tensor_parallel import TensorParallel

DECODER_LAYERS = "model.layers."  # the target's decoder layers: where quantised linears live


@dataclass
class LoadResult:
    filled: set[str] = field(default_factory=set)
    missing: dict[str, str] = field(default_factory=dict)  # parameter name -> checkpoint key not found


def load_module(
    module: nn.Module, checkpoint: Checkpoint, key_for: Callable[[str], str | None], tp: TensorParallel | None = None
) -> LoadResult:
    """Copy each parameter/persistent buffer from the checkpoint key `key_for(name)`; None skips it. The parts
    of a packed linear are read as stored, any other quantised weight dequantised. Under tensor parallelism a
    parameter smaller than its tensor gets this rank's slice of it (`tp`: another rank's, as a faulty engine
    computes it), and only that slice is read."""
    result = LoadResult()
    tp = tp or tensor_parallel.current()
    packed_parts = {
        f"{owner}.{part}" for owner, linear in module.named_modules() if isinstance(linear, PackedLinear)
        for part in linear._buffers
    }  # fmt: skip
    vocab = {f"{owner}.weight".lstrip(".") for owner, part in module.named_modules() if is_vocab_parallel(part)}
    segmented = {  # tensors whose rows are segments laid end to end, each split (models/gated_deltanet.py)
        f"{owner}.{name}".lstrip("."): sizes
        for owner, part in module.named_modules()
        for name, sizes in getattr(part, "tp_segments", {}).items()
    }
    for name, target in module.state_dict(keep_vars=True).items():
        key = key_for(name)
        if key is None:
            continue
        stored = name in packed_parts
        info = (checkpoint.stored if stored else checkpoint.tensors).get(key)
        if info is None:
            result.missing[name] = key
            continue
        if name in segmented and tuple(info.shape) != tuple(target.shape):
            shard = (0, segment_ranges(segmented[name], tp))
        else:
            shard = shard_range(tuple(info.shape), tuple(target.shape), name in vocab, tp)
        if tuple(info.shape) != tuple(target.shape) and shard is None:
            raise CheckpointError(
                f"{checkpoint.path}: tensor {key!r} has shape {tuple(info.shape)}, the model expects "
                f"{tuple(target.shape)}"
            )
        with torch.no_grad():
            if target.is_meta:  # allocated lazily: the tensor gets its storage now, a map of its shard where it can
                mapped = checkpoint.mapped(key, target.dtype, stored) if checkpoint.map_weights and not shard else None
                if mapped is None:
                    mapped = torch.empty_like(target, device="cpu")
                    read_slice(checkpoint, key, shard, mapped, stored)
                replace_tensor(module, name, mapped)
            else:
                read_slice(checkpoint, key, shard, target, stored)
        result.filled.add(name)
    return result


def read_slice(
    checkpoint: Checkpoint, key: str, shard: tuple[int, int, int] | None, target: torch.Tensor, stored: bool
) -> None:
    """Read tensor `key` (as stored: a packed weight's part), or its (dim, start, end) slice, into `target`: rows
    straight into it, columns through a map of the file (only the pages holding them are read); rows of
    `target` past the slice are a vocabulary's padding, zero."""
    read = checkpoint.read_stored if stored else checkpoint.read
    if shard is None:
        read(key, out=target)
        return
    if isinstance(shard[1], list):  # a slice of each segment, rows of the whole tensor
        target.copy_(torch.cat([read(key, rows=rows) for rows in shard[1]]))
        return
    dim, start, end = shard
    if dim == 0:
        target[end - start :].zero_()
        read(key, rows=(start, end), out=target[: end - start])
    else:
        target.copy_(checkpoint.read_columns(key, start, end, stored))


def pack_linears(module: nn.Module, checkpoint: Checkpoint, key_for: Callable[[str], str | None]) -> None:
    """Put a PackedLinear in place of each decoder layer's linear whose weight the checkpoint stores quantised.
    The embedding and the heads stay floating point: the drafter's loading reads and aliases them."""
    for name, linear in list(module.named_modules()):
        key = key_for(f"{name}.weight") if name.startswith(DECODER_LAYERS) and isinstance(linear, nn.Linear) else None
        weight = checkpoint.quantized.get(key) if key else None
        if weight is None:
            continue
        local = (linear.out_features, linear.in_features)
        if weight.shape != local and shard_range(weight.shape, local, False, tensor_parallel.current()) is None:
            raise CheckpointError(f"{checkpoint.path}: {key} holds a {weight.shape} weight, the model expects {local}")
        parts = {part: checkpoint.stored[part] for part in weight.parts.values()}
        unknown = next((part for part, info in parts.items() if info.dtype not in TORCH_DTYPES), None)
        if unknown:
            raise CheckpointError(f"{checkpoint.path}: tensor {unknown!r} has unsupported dtype {parts[unknown].dtype}")
        shapes = {part: (info.shape, TORCH_DTYPES[info.dtype]) for part, info in parts.items()}
        if weight.shape != local:  # a TP rank's slice: its parts cut in proportion
            owner, _, leaf = name.rpartition(".")
            if f"{leaf}.weight" in getattr(module.get_submodule(owner), "tp_segments", {}):
                raise CheckpointError(f"{checkpoint.path}: {key}: a packed q | k | v projection is not sliced yet")
            try:
                if "shape" in weight.parts:
                    with torch.device("cpu"):  # pack_linears runs while the module is built on the meta device
                        check_weight_shape(weight, checkpoint.read_stored(weight.parts["shape"]))
                weight, shapes = sliced_parts(weight, shapes, local)
            except ValueError as err:
                raise CheckpointError(f"{checkpoint.path}: {key}: {err}") from None
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, PackedLinear(weight, shapes, linear.bias is not None))


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


def build_stage(checkpoint: Checkpoint, layers: range, has_embedding: bool, has_head: bool, packed: bool):
    """A target stage's modules, quantised linears packed where `packed` (call on the meta device: no storage)."""
    stage = TargetStage(checkpoint.config, layers, has_embedding, has_head)
    if packed:
        pack_linears(stage, checkpoint, target_key_for(checkpoint))
    return stage


def load_target_stage(
    checkpoint: Checkpoint,
    layers: range,
    has_embedding: bool,
    has_head: bool,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    packed: bool = True,
) -> TargetStage:
    """A target stage with every owned tensor read from the checkpoint; a missing one is an error. `packed`:
    quantised weights stay packed (models/packed.py), else they are dequantised at load."""
    key_for = target_key_for(checkpoint)
    build = lambda: build_stage(checkpoint, layers, has_embedding, has_head, packed)  # noqa: E731
    stage = allocate(build, dtype, device, checkpoint.map_weights)
    result = load_module(stage, checkpoint, key_for)
    materialize(stage, device)
    if result.missing:
        name, key = next(iter(result.missing.items()))
        more = f" (and {len(result.missing) - 1} more)" if len(result.missing) > 1 else ""
        raise CheckpointError(f"{checkpoint.path}: target tensor {key!r} is missing from the checkpoint{more}")
    for name, linear in stage.named_modules():
        if isinstance(linear, PackedLinear):
            try:
                linear.check_shape()
            except ValueError as err:
                raise CheckpointError(f"{checkpoint.path}: {key_for(name + '.weight')}: {err}") from None
    return stage.eval()


def load_full_target(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32, packed: bool = True) -> TargetStage:
    """The whole target in one stage (PP = 1): embedding, every layer, final norm and head."""
    return load_target_stage(checkpoint, range(checkpoint.config.num_hidden_layers), True, True, dtype, packed=packed)
