"""Reads Hugging Face-layout checkpoints: config, weight map from headers only, single tensors.

Supported layouts: `model.safetensors.index.json` + shards, a single `model.safetensors`, or
several `*.safetensors` shards without an index (their headers are scanned). Opening reads
only the safetensors headers; `read` goes through `safe_open` so only one tensor's bytes move.
"""

from __future__ import annotations

import gc
import json
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from specdoctor.errors import CheckpointError
from specdoctor.runtime.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEMO_DIR = Path(__file__).resolve().parent.parent / "demo_model"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


class TensorInfo(NamedTuple):  # a tuple: ~100,000 of them are built per open
    key: str
    shard: str  # file name relative to the checkpoint directory
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int


def resolve_model_path(model: str | Path) -> Path:
    """`demo` names the model shipped with the package; anything else is a directory."""
    return DEMO_DIR if str(model) == "demo" else Path(model).expanduser()


def read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {what} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: {what} is not valid JSON ({err})") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read {what} ({err.strerror})") from None


def read_shard_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one shard's header (8-byte little-endian length, then JSON) and check it fits the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header (claims {header_len} bytes)")
            header = json.loads(handle.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read shard ({err.strerror})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - header_len
    tensors = {}
    for key, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            dtype, shape = entry["dtype"], tuple(entry["shape"])
            expected = DTYPE_BYTES.get(dtype, 0) * _numel(shape)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {key!r}") from None
        if end > data_size:
            raise CheckpointError(
                f"{path}: truncated shard: tensor {key!r} ends at byte {end} but the file holds {data_size} data bytes"
            )
        if not 0 <= begin <= end or (dtype in DTYPE_BYTES and end - begin != expected):
            raise CheckpointError(f"{path}: corrupt safetensors header: bad offsets for tensor {key!r}")
        tensors[key] = TensorInfo(key, path.name, dtype, shape, end - begin)
    return tensors


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


class Checkpoint:
    """A checkpoint directory; records which keys were read and how many bytes (for the loaders' proofs)."""

    def __init__(self, path: str | Path):
        self.path = resolve_model_path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: model directory not found")
        self.raw_config = read_json(self.path / "config.json", "config.json")
        self.config = ModelConfig.from_dict(self.raw_config, str(self.path / "config.json"))
        self.layout, shard_of = self._weight_map()
        self.tensors = self._scan_headers(shard_of)
        self.keys_read: list[str] = []
        self.bytes_read = 0

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
        root = self.path.resolve()
        shard = (root / name).resolve()
        if root not in shard.parents:
            raise CheckpointError(f"{self.path / INDEX_FILE}: shard {name!r} lies outside the model directory")
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

    def first_present(self, candidates: list[str]) -> str | None:
        """The first candidate key the checkpoint holds, or None."""
        return next((key for key in candidates if key in self.tensors), None)

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One tensor, or rows [start, end) of it, reading only those bytes from its shard."""
        info = self.tensors.get(key)
        if info is None:
            raise CheckpointError(f"{self.path}: tensor {key!r} is not in the checkpoint")
        path = self.path / info.shard
        try:
            with safe_open(str(path), framework="pt") as handle:
                if rows is None:
                    tensor = handle.get_tensor(key)
                else:
                    start, end = rows
                    if not 0 <= start <= end <= info.shape[0]:
                        raise CheckpointError(f"{path}: rows [{start}, {end}) outside {key!r} of shape {info.shape}")
                    tensor = handle.get_slice(key)[start:end]
        except CheckpointError:
            raise
        except Exception as err:  # safetensors raises several types for damaged files
            raise CheckpointError(f"{path}: cannot read tensor {key!r} ({err})") from None
        self.keys_read.append(key)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor
