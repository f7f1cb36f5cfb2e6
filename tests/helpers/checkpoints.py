"""Copies of real checkpoints with one tensor changed, written with safetensors as the original was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def copy_with_tensor(source: Path, destination: Path, key: str, change) -> Path:
    """A copy of the indexed checkpoint `source` whose tensor `key` is `change(tensor)`."""
    shutil.copytree(source, destination)
    index = json.loads((destination / "model.safetensors.index.json").read_text())
    shard = destination / index["weight_map"][key]
    tensors = load_file(str(shard))
    tensors[key] = change(tensors[key]).contiguous()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return destination


def zeroed_enorm_copy(source: Path, destination: Path, layer: int) -> Path:
    """The MTP layer's enorm weight zeroed: the drafter sees no token embedding at all, which is exactly
    what a zero-filled drafter embedding does (enorm(0) = 0)."""
    return copy_with_tensor(source, destination, f"model.layers.{layer}.enorm.weight", lambda tensor: tensor * 0)
