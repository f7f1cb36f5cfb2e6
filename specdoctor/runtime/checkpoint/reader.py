"""Reads Hugging Face-layout checkpoints: config, weight map from headers only, single tensors.

Supported layouts: `model.safetensors.index.json` + shards, a single `model.safetensors`, or
several `*.safetensors` shards without an index (their headers are scanned). Opening reads
only the safetensors headers; `read` reads one tensor's bytes (or some of its rows) and no more.
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from specdoctor.errors import CheckpointError
from specdoctor.runtime.checkpoint.files import (
    DTYPE_BYTES,
    INDEX_FILE,
    SINGLE_FILE,
    TORCH_DTYPES,
    TensorInfo,
    _numel,
    map_bytes,
    read_exactly,
    read_json,
    read_shard_header,
    resolve_model_path,
)
from specdoctor.runtime.models.registry import FAMILIES, is_runnable, read_config
from specdoctor.runtime.quantization import dequantize, quantization_scheme, scan


class Checkpoint:
    """A checkpoint directory; records which keys were read and how many bytes (for the loaders' proofs)."""

    what = "model"

    def __init__(self, path: str | Path):
        self.path = resolve_model_path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: {self.what} directory not found")
        self.raw_config = read_json(self.path / "config.json", "config.json")
        self.config = self.read_config(self.raw_config, str(self.path / "config.json"))
        self.layout, shard_of = self._weight_map()
        self.stored = self._scan_headers(shard_of)  # every tensor as the shards hold it
        self.quantization = quantization_scheme(self.raw_config, self.stored)  # None: floating-point weights
        self.quantized, self.quantization_problems = scan(self.raw_config, self.stored)
        self.tensors = self._logical_tensors()  # a quantised weight appears once, under its own key
        self.keys_read: list[str] = []
        self.bytes_read = 0
        # Load tensors as copy-on-write maps of their shards instead of reading them (`mapped`): a rank of a
        # model larger than the machine measured without holding it (runtime/memory.py).
        self.map_weights = False

    def _weight_map(self) -> tuple[str, dict[str, str] | None]:
        """(layout name, key -> shard from the index, or None when headers alone define it)."""
        index_path = self.path / INDEX_FILE
        if index_path.exists():
            index = read_json(index_path, "checkpoint index")
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index_path}: no valid 'weight_map' object")
            return "index", weight_map
        if (self.path / SINGLE_FILE).exists():
            return "single", None
        if any(self.path.glob("*.safetensors")):
            return "shards", None
        raise CheckpointError(f"{self.path}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors shards found")

    def _shard_path(self, name: str) -> Path:
        # The name must stay inside the directory; the file may be a link out of it, as the Hugging Face
        # cache's snapshot files are (links into its blobs/).
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise CheckpointError(f"{self.path / INDEX_FILE}: shard {name!r} lies outside the model directory")
        shard = self.path / name
        if not shard.is_file():
            raise CheckpointError(f"{self.path / INDEX_FILE}: shard {name!r} does not exist")
        return shard

    def _scan_headers(self, shard_of: dict[str, str] | None) -> dict[str, TensorInfo]:
        if shard_of is None:
            single = self.layout == "single"
            shards = [SINGLE_FILE] if single else sorted(p.name for p in self.path.glob("*.safetensors"))
        else:
            shards = sorted(set(shard_of.values()))
        tensors: dict[str, TensorInfo] = {}
        gc.disable()  # ~100,000 small objects: the cyclic collector would rescan them over and over
        try:
            for name in shards:
                for key, info in read_shard_header(self._shard_path(name)).items():
                    if shard_of is not None and shard_of.get(key) != name:
                        continue  # the index is authoritative about where a key lives
                    if key in tensors:
                        raise CheckpointError(
                            f"{self.path}: tensor {key!r} appears in both {tensors[key].shard} and {name}"
                        )
                    tensors[key] = info
        finally:
            gc.enable()
        if shard_of is not None and len(tensors) != len(shard_of):
            key, name = next((k, n) for k, n in shard_of.items() if k not in tensors)
            raise CheckpointError(f"{self.path / INDEX_FILE}: tensor {key!r} is listed in {name} but not stored there")
        return tensors

    def _logical_tensors(self) -> dict[str, TensorInfo]:
        parts = {key for weight in self.quantized.values() for key in weight.parts.values()}
        tensors = {key: info for key, info in self.stored.items() if key not in parts}
        for key, weight in self.quantized.items():
            first = self.stored[next(iter(weight.parts.values()))]
            nbytes = DTYPE_BYTES[weight.dtype] * _numel(weight.shape)
            tensors[key] = TensorInfo(key, first.shard, weight.dtype, weight.shape, nbytes, -1)  # no byte range
        return tensors

    @staticmethod
    def read_config(raw, source: str):
        return read_config(raw, source)

    def unrunnable_reason(self) -> str | None:
        """Why the runtime will not compute with this checkpoint, or None: an architecture it does not run,
        or quantised weights it does not dequantise (never cast without their scales)."""
        if self.config.runtime_refusal:
            return f"the runtime does not run this {self.config.architecture} config: {self.config.runtime_refusal}"
        if not is_runnable(self.config):
            return f"the runtime does not run {self.config.architecture} yet (it runs {', '.join(FAMILIES)})"
        return self.quantization_refusal()

    def quantization_refusal(self) -> str | None:
        if self.quantization_problems:
            more = len(self.quantization_problems) - 1
            return f"{self.quantization} weights: {self.quantization_problems[0]}" + (
                f" (and {more} more)" if more else ""
            )
        return None

    def require_runnable(self) -> None:
        reason = self.unrunnable_reason()
        if reason:
            raise CheckpointError(
                f"{self.path}: {reason}, so it will not run them; inspect and check's pre-flight still read the headers"
            )

    def _read_dequantized(self, key: str, rows: tuple[int, int] | None, out: torch.Tensor | None) -> torch.Tensor:
        try:
            tensor = dequantize(self.quantized[key], self.read_stored)
        except ValueError as err:
            raise CheckpointError(f"{self.path}: {key}: {err}") from None
        tensor = tensor[rows[0] : rows[1]] if rows is not None else tensor
        if out is not None:
            out.copy_(tensor)
        return tensor

    def first_present(self, candidates: list[str]) -> str | None:
        """The first candidate key the checkpoint holds, or None."""
        return next((key for key in candidates if key in self.tensors), None)

    def read(self, key: str, rows: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor, or rows [start, end) of it, reading only those bytes from its shard. With `out`
        (the parameter waiting for it), the bytes land there directly when dtype and layout allow.
        A quantised weight is read as its parts and dequantised."""
        if key in self.quantized:
            return self._read_dequantized(key, rows, out)
        return self.read_stored(key, rows, out)

    def mapped(self, key: str, dtype: torch.dtype, stored: bool = False) -> torch.Tensor | None:
        """A copy-on-write memory map of a stored tensor, with no copy in memory (pages come from the shard
        when touched); None for a tensor that must be converted on the way (quantised, another dtype).
        `stored`: the bytes as the shard holds them, where `key` is also a quantised weight's own name."""
        info = self.stored.get(key)
        converted = key in self.quantized and not stored
        if converted or info is None or TORCH_DTYPES.get(info.dtype) != dtype or not info.nbytes:
            return None
        return map_bytes(self.path / info.shard, info.offset, info.nbytes).view(dtype).reshape(info.shape)

    def read_columns(self, key: str, start: int, end: int, stored: bool = False) -> torch.Tensor:
        """Columns [start, end) of a matrix (a row-parallel rank's slice): from a map of the shard where the bytes
        need no conversion, so only the pages holding them are read; else the whole tensor, then the slice."""
        info = self.stored.get(key)
        dtype = TORCH_DTYPES.get(info.dtype) if info is not None else None
        mapped = self.mapped(key, dtype, stored) if dtype is not None else None
        if mapped is None:
            return (self.read_stored(key) if stored else self.read(key))[:, start:end]
        columns = mapped[:, start:end]
        self.keys_read.append(key)
        self.bytes_read += columns.numel() * columns.element_size()
        return columns

    def read_stored(self, key: str, rows: tuple[int, int] | None = None, out: torch.Tensor | None = None):
        """`read` of the bytes as the shard holds them: a quantised weight's parts, never dequantised."""
        info = self.stored.get(key)
        if info is None:
            raise CheckpointError(f"{self.path}: tensor {key!r} is not in the checkpoint")
        path = self.path / info.shard
        dtype = TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {key!r} has unsupported dtype {info.dtype}")
        offset, nbytes, shape = info.offset, info.nbytes, info.shape
        if rows is not None:
            start, end = rows
            if not shape or not 0 <= start <= end <= shape[0]:
                raise CheckpointError(f"{path}: rows [{start}, {end}) outside {key!r} of shape {shape}")
            row_bytes = nbytes // shape[0] if shape[0] else 0
            offset, nbytes, shape = offset + start * row_bytes, (end - start) * row_bytes, (end - start, *shape[1:])
        direct = out is not None and (out.device.type, out.dtype, tuple(out.shape)) == ("cpu", dtype, tuple(shape))
        if direct and out.is_contiguous():
            read_exactly(path, offset, out.reshape(-1).view(torch.uint8))
            tensor = out
        else:
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            read_exactly(path, offset, tensor)
            tensor = tensor.view(dtype).reshape(shape)
            if out is not None:
                out.copy_(tensor)
        self.keys_read.append(key)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor
