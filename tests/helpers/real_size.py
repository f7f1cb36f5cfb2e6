"""A DeepSeek-V3 checkpoint at its real size (61 layers + the MTP layer, 256 experts, bf16: 1.37 TB) that takes
a few GB of disk: safetensors shards written as sparse files (the header, then `truncate` to the full size),
so every tensor has its real name, shape and byte range and reads as zeros where no data was written.

The config is DeepSeek-V3's as the hub ships it (less its FP8 quantization_config: these weights are bf16).
The tensor names are the hub's (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, ...), listed from the
runtime's modules built on the meta device, which load transformers-saved checkpoints by the same keys
(tests/oracles/test_families_mla.py). This variant leaves out the MTP layer's own copy of the embedding, as
re-exports that drop duplicated tensors do, so an engine that skips embedding sharing at PP > 1 leaves the
drafter's embedding unloaded. Data is written for the embedding, the head, and the MTP layer's tensors other
than its routed experts (which stay zeros, 22.5 GB that the content check only samples).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
SHARD_BYTES = 5 * 10**9  # the hub's shards are about this size
MTP = "model.layers.61."


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the target and its MTP layer, as the hub names them, with their shapes."""
    from specdoctor.runtime.drafter.mtp import drafter_layer_key
    from specdoctor.runtime.models.mtp import MtpDrafter
    from specdoctor.runtime.models.registry import read_config
    from specdoctor.runtime.models.stage import TargetStage

    model_config = read_config(config, "config.json")
    with torch.device("meta"):
        stage = TargetStage(model_config, range(model_config.num_hidden_layers), True, True)
        drafter = MtpDrafter(model_config)
    shapes = {name: tuple(t.shape) for name, t in stage.state_dict().items()}
    for name, tensor in drafter.state_dict().items():
        key = drafter_layer_key(model_config, name)
        if key is not None:  # not the drafter's embedding: this variant ships no MTP copy of it
            shapes[key] = tuple(tensor.shape)
    return shapes


def write_sparse_checkpoint(path: Path, config: dict, seed: int = 0) -> dict[str, tuple[int, ...]]:
    """Shards of about 5 GB holding every tensor of `config` as sparse files, with random data for the keys of
    `mtp_data_keys` (the MTP layer's head a copy of lm_head, as DeepSeek-V3 ships it); returns every shape."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    shapes = tensor_shapes(config)
    written = mtp_data_keys(shapes)
    shards: list[list[str]] = [[]]
    size = 0
    for key in sorted(shapes, key=layer_order):
        nbytes = 2 * math.prod(shapes[key])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    weight_map, total = {}, 0
    locations: dict[str, tuple[Path, int]] = {}
    for index, keys in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for key in keys:
            nbytes = 2 * math.prod(shapes[key])
            header[key] = {"dtype": "BF16", "shape": list(shapes[key]), "data_offsets": [offset, offset + nbytes]}
            weight_map[key] = name
            offset += nbytes
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with (path / name).open("wb") as shard:
            shard.write(struct.pack("<Q", len(encoded)) + encoded)
            shard.truncate(8 + len(encoded) + offset)  # a hole: no disk, reads as zeros
        for key in keys:
            locations[key] = (path / name, 8 + len(encoded) + header[key]["data_offsets"][0])
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    copies = {"lm_head.weight": [MTP + "shared_head.head.weight"]}  # DeepSeek-V3's MTP head is a copy of lm_head
    for index, key in enumerate(sorted(written - {k for same in copies.values() for k in same})):
        targets = [locations[name] for name in [key, *copies.get(key, [])]]
        for shard, start in targets:  # rows a chunk at a time: no table-sized temporary
            with shard.open("r+b") as handle:
                handle.seek(start)
                for chunk in random_rows(shapes[key], key.endswith("norm.weight"), seed + index):
                    handle.write(memoryview(chunk.view(torch.uint8).numpy()))
    return shapes


def random_rows(shape: tuple[int, ...], norm: bool, seed: int, chunk_elements: int = 1 << 24):
    """A tensor's bf16 values, chunk by chunk along its rows: weights ~ N(0, 0.02), norm weights ~ 1 + N(0, 0.02)."""
    generator = torch.Generator().manual_seed(seed)
    rows, width = shape[0], math.prod(shape[1:])
    step = max(1, chunk_elements // max(width, 1))
    for start in range(0, rows, step):
        values = torch.randn(min(step, rows - start), width, generator=generator).mul_(0.02)
        yield (values.add_(1.0) if norm else values).to(torch.bfloat16)


def mtp_data_keys(shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """The embedding, the head and the MTP layer's tensors other than its routed experts."""
    mtp = {key for key in shapes if key.startswith(MTP) and ".mlp.experts." not in key}
    return mtp | {"model.embed_tokens.weight", "lm_head.weight"}


def layer_order(key: str) -> tuple[int, str]:
    parts = key.split(".")
    layer = int(parts[2]) if key.startswith("model.layers.") else (-1 if "embed" in key else 10**6)
    return layer, key
