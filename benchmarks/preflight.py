"""Time to a pre-flight verdict from headers alone on an index the size of a 700B-parameter MoE.

Generates a checkpoint whose keys follow DeepSeek-V3's layout (61 layers, 256 routed experts,
FP8-style weight + scale pairs, one MTP layer: about 100,000 keys in 32 shards; the tensors
themselves are tiny, since pre-flight reads no tensor data), then times opening it and running
every pre-flight check:

    python -m benchmarks.preflight [--shards 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import save_file

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.checks.preflight import preflight
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.models.glm4_moe import MtpLayer
from specdoctor.runtime.models.registry import read_config
from specdoctor.runtime.partition import placements

CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"],
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 61,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "moe_intermediate_size": 16,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
}


def layer_keys(layer: int, moe: bool) -> list[str]:
    prefix = f"model.layers.{layer}."
    keys = [prefix + k for k in ("input_layernorm.weight", "post_attention_layernorm.weight")]
    keys += [
        f"{prefix}self_attn.{p}.{w}"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        for w in ("weight", "weight_scale_inv")
    ]
    projections = ("gate_proj", "up_proj", "down_proj")
    if moe:
        keys += [
            f"{prefix}mlp.experts.{e}.{p}.{w}"
            for e in range(CONFIG["n_routed_experts"])
            for p in projections
            for w in ("weight", "weight_scale_inv")
        ]
        keys += [f"{prefix}mlp.experts.{e}.down_proj.input_scale" for e in range(CONFIG["n_routed_experts"])]
        keys += [f"{prefix}mlp.shared_experts.{p}.weight" for p in projections]
        keys += [prefix + "mlp.gate.weight", prefix + "mlp.gate.e_score_correction_bias"]
    else:
        keys += [f"{prefix}mlp.{p}.weight" for p in projections]
    return keys


def build(path: Path, shards: int) -> int:
    (path / "config.json").write_text(json.dumps(CONFIG))
    tiny = torch.zeros(1, dtype=torch.bfloat16)
    tensors = {k: tiny for layer in range(CONFIG["num_hidden_layers"]) for k in layer_keys(layer, layer >= 3)}
    tensors["model.embed_tokens.weight"] = torch.zeros(1024, 64, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.zeros(1024, 64, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = tiny
    with torch.device("meta"):
        mtp = MtpLayer(read_config(CONFIG), 61)
    for name, value in mtp.state_dict().items():
        tensors[f"model.layers.61.{name}"] = torch.zeros(value.shape, dtype=torch.bfloat16)
    keys = sorted(tensors)
    weight_map = {}
    for number in range(shards):
        name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        chunk = keys[number::shards]
        save_file({k: tensors[k].clone() for k in chunk}, str(path / name))
        weight_map.update({k: name for k in chunk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    add_json_option(parser, "preflight")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = build(Path(tmp), args.shards)
        timings = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            checkpoint = Checkpoint(tmp)
            opened = time.perf_counter()
            findings = preflight(checkpoint, placements(checkpoint.config, args.pp))
            timings.append((opened - start, time.perf_counter() - opened))
        assert checkpoint.bytes_read == 0
    best_open, best_checks = min(timings, key=sum)
    table = Table(title=f"Pre-flight from headers: {keys:,} keys in {args.shards} shards, PP {args.pp}")
    for column in ("step", "best of " + str(args.repeats)):
        table.add_column(column)
    table.add_row("open: index + every shard header", f"{best_open * 1000:.0f} ms")
    table.add_row(f"pre-flight checks ({len(findings)} findings)", f"{best_checks * 1000:.0f} ms")
    table.add_row("total", f"{(best_open + best_checks) * 1000:.0f} ms")
    table.add_row("tensor bytes read", "0")
    Console().print(table)
    Console().print(f"machine: {machine()}")
    write_json(args.json, {"keys": keys, "shards": args.shards, "open_s": best_open, "checks_s": best_checks})


if __name__ == "__main__":
    main()
