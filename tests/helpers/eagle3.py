"""EAGLE-3 heads written by speculators (tests/tools/speculators_tool.py, in its own environment) for a Llama
target transformers saved, and the original EAGLE-3 release layout converted from one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.helpers.families import save_dense_checkpoint
from tests.tools import TOOLS
from tests.tools.speculators_env import run_speculators

TOOL = TOOLS / "speculators_tool.py"
TARGET_LAYERS = 8  # vLLM's default aux entries (2, 4, 5) differ from the heads' (1, 3, 6)
TRAINED_AUX = "1,3,6"


def run_tool(*args: str) -> None:
    run_speculators(TOOL, *args)


def save_llama_target(path: Path, seed: int = 0) -> None:
    save_dense_checkpoint(path, "LlamaForCausalLM", seed, num_hidden_layers=TARGET_LAYERS)


def write_head(out: Path, target: Path, draft_vocab: int, aux: str = TRAINED_AUX, *options: str) -> Path:
    """An EAGLE-3 head in the speculators format, as its training tool saves one (embedding and pruned head
    taken from the target)."""
    run_tool("write", str(out), "--target", str(target), "--aux", aux, "--draft-vocab", str(draft_vocab), *options)
    return out


def without_tensors(source: Path, out: Path, *keys: str) -> Path:
    """A copy of a head without some of its tensors (a head that takes the target's embedding and head)."""
    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in keys}, str(out / "model.safetensors"))
    return out


def original_layout(source: Path, out: Path) -> Path:
    """The head as the original EAGLE-3 release lays it out (`LlamaForCausalLMEagle3`): a flat Llama config
    with draft_vocab_size and no aux ids, `midlayer.*` keys. `source` must be written without
    norm_before_residual and for the engine's default aux ids, which is what such a config means."""
    out.mkdir()
    config = json.loads((source / "config.json").read_text())
    flat = {**config["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"]}
    flat["draft_vocab_size"] = config["draft_vocab_size"]
    (out / "config.json").write_text(json.dumps(flat, indent=2))
    tensors = load_file(str(source / "model.safetensors"))
    renamed = {key.replace("layers.0.", "midlayer.", 1): value for key, value in tensors.items()}
    save_file(renamed, str(out / "model.safetensors"))
    return out
