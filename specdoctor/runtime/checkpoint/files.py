"""The safetensors files of a checkpoint: where a model name resolves to, the demo models, shard headers
read without reading tensor data, and exact reads of byte ranges."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from specdoctor.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


SINGLE_FILE = "model.safetensors"


# The demo models shipped with the package, by the name `--model` takes: GLM-4.5's layout, GLM-5's (MLA + DSA),
# Qwen3.5-MoE's, the first quantised to W4A16 by llm-compressor (the seed deployment's scheme), and a dense
# Qwen3 whose drafter is a DSpark checkpoint of its own (the default --speculative-model for it).
PACKAGE_DIR = Path(__file__).resolve().parents[2]


DEMO_MODELS = {
    name: PACKAGE_DIR / folder
    for name, folder in (
        ("demo", "demo_model"),
        ("demo-mla", "demo_mla_model"),
        ("demo-hybrid", "demo_hybrid_model"),
        ("demo-w4a16", "demo_w4a16_model"),
        ("demo-dspark", "demo_dspark_model"),
        ("demo-eagle3", "demo_dspark_model"),  # the same Qwen3 target, with an EAGLE-3 head instead
    )
}


DEMO_DRAFTERS = {"demo-dspark": PACKAGE_DIR / "demo_dspark_drafter", "demo-eagle3": PACKAGE_DIR / "demo_eagle3_drafter"}


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


def map_bytes(path: Path, offset: int, nbytes: int) -> torch.Tensor:
    """`nbytes` of the file at `offset` as a uint8 tensor over a private (copy-on-write) memory map."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        with path.open("rb") as handle:
            mapping = mmap.mmap(handle.fileno(), nbytes + offset - start, offset=start, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: cannot map {nbytes} bytes at {offset} ({err})") from None
    with warnings.catch_warnings():  # the map is writable (copy-on-write): torch's non-writable warning is moot
        warnings.simplefilter("ignore")
        return torch.frombuffer(mapping, dtype=torch.uint8, offset=offset - start, count=nbytes)


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
