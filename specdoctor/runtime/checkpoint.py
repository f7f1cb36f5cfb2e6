"""Reads Hugging Face-layout checkpoints: config, weight map from headers only, single tensors.

Supported layouts: `model.safetensors.index.json` + shards, a single `model.safetensors`, or
several `*.safetensors` shards without an index (their headers are scanned). Opening reads
only the safetensors headers; `read` reads one tensor's bytes (or some of its rows) and no more.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import struct
from pathlib import Path
from typing import NamedTuple

import torch

from specdoctor.errors import CheckpointError
from specdoctor.runtime.models.dspark import read_dspark_config
from specdoctor.runtime.models.registry import FAMILIES, is_runnable, read_config
from specdoctor.runtime.quantization import dequantize, quantization_scheme, scan

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The demo models shipped with the package, by the name `--model` takes: GLM-4.5's layout, GLM-5's (MLA + DSA),
# Qwen3.5-MoE's, the first quantised to W4A16 by llm-compressor (the seed deployment's scheme), and a dense
# Qwen3 whose drafter is a DSpark checkpoint of its own (the default --speculative-model for it).
PACKAGE_DIR = Path(__file__).resolve().parent.parent
DEMO_MODELS = {
    name: PACKAGE_DIR / folder
    for name, folder in (
        ("demo", "demo_model"),
        ("demo-mla", "demo_mla_model"),
        ("demo-hybrid", "demo_hybrid_model"),
        ("demo-w4a16", "demo_w4a16_model"),
        ("demo-dspark", "demo_dspark_model"),
    )
}
DEMO_DRAFTERS = {"demo-dspark": PACKAGE_DIR / "demo_dspark_drafter"}
DEMO_DIR = DEMO_MODELS["demo"]
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit

TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # power-of-two block scales (ue8m0)
}
DTYPE_BYTES = {code: dtype.itemsize for code, dtype in TORCH_DTYPES.items()}


class TensorInfo(NamedTuple):  # a tuple: ~100,000 of them are built per open
    key: str
    shard: str  # file name relative to the checkpoint directory
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # where its bytes start in the shard file


def resolve_model_path(model: str | Path) -> Path:
    """`demo` and `demo-mla` name the models shipped with the package; a directory is itself; an `org/name`
    that is not a directory is looked up in the local Hugging Face cache, as vLLM does (never downloaded)."""
    if str(model) in DEMO_MODELS:
        return DEMO_MODELS[str(model)]
    path = Path(model).expanduser()
    if path.exists() or str(model).count("/") != 1 or str(model).startswith((".", "/", "~")):
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(model), local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        raise CheckpointError(
            f"{model}: not a directory, and not in the local Hugging Face cache ({HF_HUB_CACHE}); "
            "nothing is downloaded: fetch it first (huggingface-cli download) or give a path"
        ) from None


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
            if hasattr(os, "posix_fadvise"):  # only the header: no read-ahead into the tensors
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
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
        tensors[key] = TensorInfo(key, path.name, dtype, shape, end - begin, 8 + header_len + begin)
    return tensors


def read_exactly(path: Path, offset: int, into: torch.Tensor) -> None:
    """Fill the uint8 tensor `into` with the file's bytes at `offset`: one sequential read straight
    into the destination (a memory-mapped read would fault in whole read-around windows and copy
    again). The kernel's read-ahead stays on: without it the read is about half as fast
    (benchmarks/repair_io.py), with it a few MB past the tensor are read too."""
    buffer = memoryview((ctypes.c_char * into.numel()).from_address(into.data_ptr())).cast("B") if into.numel() else b""
    try:
        with path.open("rb", buffering=0) as handle:
            handle.seek(offset)
            done = 0
            while done < len(buffer):
                count = handle.readinto(buffer[done:])
                if not count:
                    raise CheckpointError(
                        f"{path}: truncated shard: {len(buffer) - done} bytes missing at {offset + done}"
                    )
                done += count
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read shard ({err.strerror})") from None


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


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
            tensor = dequantize(self.quantized[key], self._read_stored)
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
        return self._read_stored(key, rows, out)

    def _read_stored(self, key: str, rows: tuple[int, int] | None = None, out: torch.Tensor | None = None):
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


class DrafterCheckpoint(Checkpoint):
    """A drafter that is a checkpoint of its own (DSpark, runtime/models/dspark.py): a config the runtime runs
    or refuses outright, and its own tensors."""

    what = "drafter"

    @staticmethod
    def read_config(raw, source: str):
        return read_dspark_config(raw, source)

    def unrunnable_reason(self) -> str | None:
        return self.quantization_refusal()


def drafter_checkpoint_path(model: str, speculative_model: str | None) -> str | None:
    """The drafter checkpoint to open: the one asked for, else the one a demo model brings (named, or by its
    directory), else None."""
    if speculative_model is not None:
        return speculative_model
    path = resolve_model_path(model)
    found = next(
        (DEMO_DRAFTERS[name] for name, demo in DEMO_MODELS.items() if demo == path and name in DEMO_DRAFTERS), None
    )
    return str(found) if found else None
