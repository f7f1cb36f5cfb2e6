"""A tiny dense Qwen3 target saved by transformers' own class, and a DSpark drafter checkpoint beside it in
the layout vLLM 0.32's Qwen3DSparkForCausalLM loads (a config.json of its own, safetensors shards with
`layers.*`, `fc`, `hidden_norm`, `norm`, `markov_head.*`; no embedding or head: they are the target's)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdoctor.runtime.models.dspark import DSparkDrafter, read_dspark_config
from tests.conftest import randomize
from tests.helpers.families import SMALL

TARGET = {**SMALL, "head_dim": 16, "num_hidden_layers": 6}
MASK_TOKEN = SMALL["vocab_size"] - 1


def drafter_fields(**overrides) -> dict:
    return {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        **{name: TARGET[name] for name in ("vocab_size", "hidden_size", "intermediate_size", "head_dim")},
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": TARGET["max_position_embeddings"],
        "target_layer_ids": [1, 3, 5],
        "markov_rank": 16,
        "mask_token_id": MASK_TOKEN,
        "block_size": 4,
        **overrides,
    }


def make_target(path: Path, seed: int = 0, **overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TARGET, **overrides})).eval()
    randomize(model, seed)
    model.save_pretrained(path, max_shard_size="100KB")
    return model


def make_drafter(path: Path, seed: int = 1, shards: int = 2, **overrides) -> dict[str, torch.Tensor]:
    """A random drafter in `shards` safetensors files with an index; returns its tensors."""
    fields = drafter_fields(**overrides)
    torch.manual_seed(seed)
    drafter = DSparkDrafter(read_dspark_config(fields))
    randomize(drafter, seed)
    tensors = {
        k: v.contiguous() for k, v in drafter.state_dict().items() if k not in ("embed_tokens.weight", "lm_head.weight")
    }
    path.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    weight_map = {}
    for number in range(shards):
        name = f"model-{number + 1:05d}-of-{shards:05d}.safetensors"
        part = {key: tensors[key] for key in keys[number::shards]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    return tensors
