"""Repair I/O and its scaling: what the drafter-embedding repair reads, against the alternatives.

Generates GLM-4.5-layout checkpoints of increasing total size in 8 shards (bf16, real shapes:
hidden 2048, 16 experts per MoE layer, more layers for a bigger model) with the same 65,536 x 2048
embedding, then measures, from a cold page cache (each shard evicted with posix_fadvise):

- repair: the checkpoint-index loader (`Checkpoint.read`, what the repair and every load use):
  open the checkpoint (index and every shard header), find the embedding's key, read exactly its
  bytes into the parameter waiting for them;
- bare: `safe_open(shard).get_tensor(key)` with the shard already known, copied into the parameter;
- whole shard: the shard file read into memory and parsed (`safetensors.torch.load`), what a
  loader that reads per file does, copied into the parameter;

(safetensors maps files lazily: without the copy nothing would be read), and the header-only
pre-flight. Bytes read are the shard pages that entered the page cache (fincore), so read-ahead
counts too.

    python -m benchmarks.repair_io [--sizes 1.25,2.5,4] [--repeats 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from safetensors import safe_open
from safetensors.torch import load, save_file

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.checks.preflight import preflight
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.kind import EMBEDDING
from specdoctor.runtime.drafter.mtp import expected_key
from specdoctor.runtime.models.glm4_moe import MtpLayer
from specdoctor.runtime.models.registry import read_config
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.partition import placements

GIB = 1 << 30
CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 65536,
    "hidden_size": 2048,
    "intermediate_size": 4096,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 1024,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
}
KEY = "model.embed_tokens.weight"


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the target (embedding first, as save_pretrained orders them) and its MTP layer."""
    config = read_config({**CONFIG, "num_hidden_layers": layers})
    with torch.device("meta"):
        target = TargetStage(config, range(layers), True, True)
        mtp = MtpLayer(config, layers)
    found = {name: tuple(t.shape) for name, t in target.state_dict().items()}
    found |= {f"model.layers.{layers}.{name}": tuple(t.shape) for name, t in mtp.state_dict().items()}
    return found


def layers_for(total_bytes: float) -> int:
    per_layer = sum(2 * torch.Size(s).numel() for k, s in shapes(2).items() if k.startswith("model.layers.1."))
    fixed = sum(2 * torch.Size(s).numel() for k, s in shapes(1).items()) - per_layer
    return max(1, round((total_bytes - fixed) / per_layer))


def build(path: Path, layers: int, shards: int) -> int:
    """Write the checkpoint in `shards` files of about equal size plus an index; returns its bytes."""
    tensors = shapes(layers)
    total = sum(2 * torch.Size(s).numel() for s in tensors.values())
    (path / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}))
    weight_map, chunk, chunk_bytes, number = {}, {}, 0, 1
    names = list(tensors)
    for index, name in enumerate(names):
        chunk[name] = torch.full(tensors[name], 0.01, dtype=torch.bfloat16)
        chunk_bytes += chunk[name].nbytes
        if chunk_bytes >= total / shards * number or index == len(names) - 1:
            file = f"model-{number:05d}-of-{shards:05d}.safetensors"
            save_file(chunk, str(path / file))
            weight_map |= dict.fromkeys(chunk, file)
            chunk, number = {}, number + 1
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    os.sync()  # written pages must be clean before they can be evicted
    return total


def evict(files: list[Path]) -> None:
    for file in files:
        descriptor = os.open(file, os.O_RDONLY)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(descriptor)


def resident_bytes(files: list[Path]) -> int:
    out = subprocess.check_output(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)])
    return sum(int(line) for line in out.split())


def repair_read(path: Path, parameter: torch.Tensor) -> None:
    """Open the checkpoint (index and every shard header), find the embedding, read it into the parameter."""
    checkpoint = Checkpoint(path)
    checkpoint.read(expected_key(checkpoint, EMBEDDING), out=parameter)


def bare_read(shard: Path) -> torch.Tensor:
    with safe_open(str(shard), framework="pt") as handle:
        return handle.get_tensor(KEY)


def whole_shard_read(shard: Path) -> torch.Tensor:
    return load(shard.read_bytes())[KEY]


def cold(read, files: list[Path]) -> tuple[float, int]:
    evict(files)
    start = time.perf_counter()
    read()
    return time.perf_counter() - start, resident_bytes(files)


def measure(path: Path, repeats: int) -> dict:
    shard = path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][KEY]
    files = sorted(path.glob("*.safetensors"))
    # Every method ends with the bytes in the parameter that waits for them, as loading does.
    parameter = torch.empty(bare_read(shard).shape, dtype=torch.bfloat16)
    methods = {
        "repair": lambda: repair_read(path, parameter),
        "bare": lambda: parameter.copy_(bare_read(shard)),
        "shard": lambda: parameter.copy_(whole_shard_read(shard)),
    }
    runs = {name: [] for name in methods}
    for _ in range(repeats):  # alternate, so drift on a noisy machine hits every method alike
        for name, read in methods.items():
            runs[name].append(cold(read, files))
    start = time.perf_counter()
    checkpoint = Checkpoint(path)
    preflight(checkpoint, placements(checkpoint.config, min(4, checkpoint.config.num_hidden_layers)))
    preflight_s = time.perf_counter() - start
    result = {
        "tensor_bytes": checkpoint.tensors[KEY].nbytes,
        "shard_bytes": shard.stat().st_size,
        "preflight_s": preflight_s,
        "preflight_tensor_bytes_read": checkpoint.bytes_read,
    }
    for name, samples in runs.items():
        result[f"{name}_s"] = statistics.median(s for s, _ in samples)
        result[f"{name}_bytes_read"] = statistics.median(b for _, b in samples)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1.25,2.5,4", help="total checkpoint sizes in GiB")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)")
    add_json_option(parser, "repair_io")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, Progress(transient=True) as progress:
        sizes = [float(size) for size in args.sizes.split(",")]
        task = progress.add_task("generating and measuring checkpoints", total=len(sizes))
        for size in sizes:
            path = Path(tmp) / f"model-{size}g"
            path.mkdir()
            layers = layers_for(size * GIB)
            total = build(path, layers, args.shards)
            rows.append({"total_bytes": total, "layers": layers, "shards": args.shards, **measure(path, args.repeats)})
            for file in path.iterdir():
                file.unlink()
            progress.advance(task)
    console = Console(width=160)
    table = Table(
        title=f"Embedding repair from a cold page cache, median of {args.repeats}; embedding 65,536 x 2048 bf16"
    )
    columns = ["checkpoint", "repair read", "repair time", "bare read", "bare time", "repair read / tensor"]
    columns += ["repair time / bare"]
    columns += ["whole shard", "shard time", "pre-flight"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        tensor = row["tensor_bytes"]
        table.add_row(
            f"{row['total_bytes'] / GIB:.2f} GiB, {row['layers']} layers",
            f"{row['repair_bytes_read'] / 2**20:.1f} MiB",
            f"{row['repair_s']:.3f} s",
            f"{row['bare_bytes_read'] / 2**20:.1f} MiB",
            f"{row['bare_s']:.3f} s",
            f"{row['repair_bytes_read'] / tensor:.3f}x",
            f"{row['repair_s'] / row['bare_s']:.2f}x",
            f"{row['shard_bytes_read'] / 2**20:.0f} MiB",
            f"{row['shard_s']:.3f} s",
            f"{row['preflight_s'] * 1000:.0f} ms",
        )
    console.print(table)
    console.print(f"tensor: {rows[0]['tensor_bytes'] / 2**20:.0f} MiB; machine: {machine()}")
    write_json(args.json, {"settings": {**vars(args), "json": str(args.json), "dir": str(args.dir)}, "rows": rows})


if __name__ == "__main__":
    main()
