"""Real checkpoints for the tests, made with transformers' own classes in temporary directories."""

from __future__ import annotations

import json
import os
import sys
import threading

# Triton kernels run on the CPU through the interpreter; decided when a kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SPECDOCTOR_POISON_OUTPUTS", "1")
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdoctor.runtime.compile import LayerGraphs
from specdoctor.runtime.models.glm4_moe import MtpLayer
from specdoctor.runtime.models.registry import read_config

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=1.5,
    use_qk_norm=True,
    attention_bias=True,
    num_nextn_predict_layers=1,
    max_position_embeddings=512,
    eos_token_id=None,
)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that routing and attention are far from uniform (a sharper test)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("inv_freq"):
                continue
            if "norm" in name:
                tensor.copy_(1.0 + 0.2 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(0.15 * torch.randn(tensor.shape, generator=generator))


def add_mtp_layers(path: Path, seed: int) -> None:
    """Append MTP layer tensors (keys under model.layers.{N + i}.) as one more indexed shard."""
    config = read_config(json.loads((path / "config.json").read_text()))
    torch.manual_seed(seed)
    tensors = {}
    for layer_id in config.mtp_layer_ids:
        layer = MtpLayer(config, layer_id)
        randomize(layer, seed + layer_id)
        tensors.update({f"model.layers.{layer_id}.{k}": v.contiguous() for k, v in layer.state_dict().items()})
    shard = "model-mtp.safetensors"
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({key: shard for key in tensors})
    index_path.write_text(json.dumps(index, indent=2))


def make_hf_checkpoint(path: Path, seed: int = 0, shard_size: str = "60KB", **overrides):
    """Save a random transformers Glm4MoeForCausalLM (several shards + index) plus MTP tensors."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**TINY, **overrides})).eval()
    randomize(model, seed)
    model.save_pretrained(path, max_shard_size=shard_size)
    if model.config.num_nextn_predict_layers:
        add_mtp_layers(path, seed + 1000)
    return model


def pytest_collection_modifyitems(config, items):
    """The oracle tools' environments the selected tests need (`pytest.mark.tool_env`), installed now: after
    collection, before any test's timeout starts."""
    from tests.helpers.tool_env import install_before_the_tests
    from tests.helpers.tool_envs import TOOL_ENVS

    # The files with the long tests first (a slow test's, or an oracle tool's servers), so that the two test
    # processes do not end with one of them alone on the longest file (CI's tail was 6 minutes of one process).
    long_files = {item.path for item in items if item.get_closest_marker("slow") or item.get_closest_marker("tool_env")}
    items.sort(key=lambda item: item.path not in long_files)  # stable: each file's own order kept
    names = sorted({marker.args[0] for item in items for marker in item.iter_markers("tool_env")})
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    worker = getattr(config, "workerinput", {}).get("workerid")  # pytest-xdist's: every worker collects
    if worker or reporter is None:  # a worker's stderr is the terminal's; its reporter's output is dropped

        def say(line):
            print(f"[{worker}] {line}" if worker else line, file=sys.stderr, flush=True)
    else:
        say = reporter.write_line
    install_before_the_tests([TOOL_ENVS[name] for name in names], say)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """(directory, transformers model) of the default tiny checkpoint."""
    path = tmp_path_factory.mktemp("hf_tiny")
    return path, make_hf_checkpoint(path)


@pytest.fixture
def compile_cache(tmp_path, monkeypatch) -> Path:
    """An empty compile cache of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # compile_layers sets it; restored after
    return tmp_path


@pytest.fixture(scope="session")
def shared_compile_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture
def demo_compile_cache(shared_compile_cache, monkeypatch) -> Path:
    """A compile cache shared by the tests that compile the demo without testing what a cold cache does: the first
    compiles its graphs (minutes on 2 cores), the later ones load them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(shared_compile_cache))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # compile_layers sets it; restored after
    return shared_compile_cache


@pytest.fixture
def gated_compiles(monkeypatch):
    """The compile threads' jobs wait for this event: the test says when graphs may arrive (never, unless it sets
    it: every pass then runs eager and asks for its graph)."""
    gate, run_job = threading.Event(), LayerGraphs.run_job

    def held(self, job):
        gate.wait()
        return run_job(self, job)

    monkeypatch.setattr(LayerGraphs, "run_job", held)
    return gate
