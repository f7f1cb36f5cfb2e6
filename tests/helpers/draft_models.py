"""Draft models for a target, each saved by transformers' own classes: the target's first layers (its own
weights, so it agrees with the target part of the time), the target itself under a shorter position range,
or a model of another family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers.families import save_dense_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_target(path: Path) -> Path:
    save_dense_checkpoint(path, "Qwen3ForCausalLM", seed=0)
    return path


def save_cut_down(target: Path, out: Path, **changes) -> Path:
    """The target as transformers loads it with `changes` to its config (num_hidden_layers: its first layers
    only; max_position_embeddings: a shorter range), saved again in several shards with its tokenizer."""
    import torch
    import transformers

    raw = json.loads((target / "config.json").read_text())
    raw = {**raw, **changes}
    if "num_hidden_layers" in changes:
        raw.pop("layer_types", None)  # transformers derives it again for the new layer count
    config = transformers.AutoConfig.for_model(**raw)
    model = transformers.AutoModelForCausalLM.from_pretrained(target, config=config, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="100KB")
    for name in TOKENIZER_FILES:
        if (target / name).exists():
            shutil.copy(target / name, out / name)
    return out


def save_other_family(out: Path, **overrides) -> Path:
    """A one-layer Llama with the target's vocabulary: a draft model of another family, random weights."""
    save_dense_checkpoint(out, "LlamaForCausalLM", seed=1, num_hidden_layers=1, **overrides)
    return out
