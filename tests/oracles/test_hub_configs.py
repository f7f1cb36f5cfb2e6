"""Every runtime family on a checkpoint saved by transformers' own class with its config class's defaults: only
sizes are overridden (vocabulary, hidden size, layers, heads, head and latent widths, experts), every other field
is what the class writes, in several shards. The runtime must read the config transformers wrote (no field it
requires may be one the class leaves out), compute transformers' logits, and `check --pp 2` must run its runtime
stages. The same for the multimodal Qwen3.5 releases, whose config nests the text model under `text_config` and
whose weights lie under `model.language_model.` beside a vision tower.

transformers saves no MTP layer, so one is appended in the hub layout (the family's last decoder block plus the
layout's own tensors) and its count named where the class writes none; dense Qwen3 drafts with a DSpark drafter
checkpoint of its own. DeepSeek-V3, V3.2 and GLM-5: transformers' configs name no router, and vLLM then routes
with softmax and no correction bias where transformers uses sigmoid with it: the runtime computes the architecture's
(transformers') model and the pre-flight reports vLLM's as an error (docs/engine-semantics.md §MLA and DSA).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdoctor.runtime.architectures import ARCHITECTURES
from specdoctor.runtime.checkpoint.loader import load_full_target
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.models.registry import FAMILIES, read_config
from tests.commands.test_check import specdoctor
from tests.conftest import randomize
from tests.helpers.dspark import make_drafter
from tests.helpers.families import mtp_tensors, saved_tensors
from tests.oracles.test_model_parity import relative_error

SIZES = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
GQA = {**SIZES, "num_key_value_heads": 2}
HEAD = dict(head_dim=16)  # the classes with a head_dim field default it to 128 or 256
MLA = dict(
    SIZES, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=16, num_experts_per_tok=2,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
)  # fmt: skip
DSA = dict(index_n_heads=2, index_head_dim=16)
LINEAR = dict(HEAD, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)

# architecture (transformers' model class): (its config class, the sizes given to it)
TEXT = {
    "Glm4MoeForCausalLM": (
        "Glm4MoeConfig",
        {**GQA, "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2},
    ),
    "Qwen3ForCausalLM": ("Qwen3Config", {**GQA, **HEAD, "intermediate_size": 96}),
    "LlamaForCausalLM": ("LlamaConfig", {**GQA, **HEAD, "intermediate_size": 96}),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", {**MLA, "n_routed_experts": 16}),  # 8 groups: 2 experts each
    "DeepseekV32ForCausalLM": ("DeepseekV32Config", {**MLA, **DSA, "n_routed_experts": 16}),
    "Glm4MoeLiteForCausalLM": ("Glm4MoeLiteConfig", {**MLA, "n_routed_experts": 8}),
    "GlmMoeDsaForCausalLM": ("GlmMoeDsaConfig", {**MLA, **DSA, "n_routed_experts": 8}),
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", {**GQA, **LINEAR, **QWEN_MOE, "intermediate_size": 96}),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", {**GQA, **LINEAR, **QWEN_MOE}),  # no intermediate_size field
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", {**GQA, **LINEAR, "intermediate_size": 96}),
}
VISION = dict(
    depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, num_position_embeddings=16
)  # fmt: skip
# the multimodal releases: (config class, the text model's architecture); its text sizes are that model's
NESTED = {
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeConfig", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5Config", "Qwen3_5ForCausalLM"),
}
ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}  # what the released configs name
NAMES_NO_ROUTER = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


@dataclass
class Made:
    path: Path
    model: torch.nn.Module  # transformers' own
    written: dict  # config.json as transformers wrote it
    refusal: str | None  # the runtime's word on that config.json, before the MTP layer was added
    drafter: Path | None = None  # a drafter checkpoint of its own (dense Qwen3 and Llama)


def save(path: Path, architecture: str, config) -> tuple[torch.nn.Module, dict, str | None]:
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    randomize(model, 0)
    model.save_pretrained(path, max_shard_size="100KB")
    return model, json.loads((path / "config.json").read_text()), Checkpoint(path).unrunnable_reason()


def append_mtp_layer(path: Path, tensors: dict[str, torch.Tensor], count_field: str, nested: bool) -> None:
    """The MTP tensors as one more indexed shard; the MTP layer count named where the class wrote none."""
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(path / "model-mtp.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    if not Checkpoint(path).config.num_nextn_predict_layers:
        (config["text_config"] if nested else config)[count_field] = 1
    (path / "config.json").write_text(json.dumps(config))


def nested_mtp_tensors(architecture: str, path: Path, text) -> dict[str, torch.Tensor]:
    """Qwen3.5's `mtp.*` drafter beside a multimodal checkpoint: its last (full-attention) text layer as saved under
    `model.language_model.`, renamed, and the layout's own tensors (random; norms near 1)."""
    layout = ARCHITECTURES[architecture].mtp
    last = f"model.language_model.layers.{text.num_hidden_layers - 1}."
    out = {layout.prefix(0) + key[len(last) :]: value.clone() for key, value in saved_tensors(path, last).items()}
    generator = torch.Generator().manual_seed(7)
    for key in (*(layout.prefix(0) + name for name in layout.layer_keys), *layout.shared_keys):
        shape = (text.hidden_size, 2 * text.hidden_size) if key.endswith("fc.weight") else (text.hidden_size,)
        noise = torch.randn(shape, generator=generator)
        out[key] = 1 + 0.2 * noise if "norm" in key else 0.15 * noise
    return out


def make(path: Path, architecture: str) -> Made:
    import transformers

    if architecture in NESTED:
        config_class, text_architecture = NESTED[architecture]
        sizes = TEXT[text_architecture][1]
        config = getattr(transformers, config_class)(text_config=sizes, vision_config=VISION)
        model, written, refusal = save(path, architecture, config)
        tensors = nested_mtp_tensors(architecture, path, config.text_config)
        append_mtp_layer(path, tensors, ARCHITECTURES[architecture].mtp.count_fields[0], nested=True)
        return Made(path, model, written, refusal)
    config_class, sizes = TEXT[architecture]
    model, written, refusal = save(path, architecture, getattr(transformers, config_class)(**sizes))
    layout = ARCHITECTURES[architecture].mtp
    if not layout.count_fields:  # dense Qwen3 and Llama: their drafter is a checkpoint of its own
        drafter = path.parent / f"{path.name}-dspark"
        make_drafter(drafter, target_layer_ids=[0, 2, 3])
        return Made(path, model, written, refusal, drafter)
    append_mtp_layer(path, mtp_tensors(architecture, path, model.config), layout.count_fields[0], nested=False)
    return Made(path, model, written, refusal)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """made(architecture) -> Made, each checkpoint made once, when first asked for."""
    made: dict[str, Made] = {}

    def get(architecture: str) -> Made:
        if architecture not in made:
            made[architecture] = make(tmp_path_factory.mktemp(architecture), architecture)
        return made[architecture]

    return get


def test_every_runtime_family_is_covered():
    assert set(TEXT) | set(NESTED) == set(FAMILIES)


def logits_error(made: Made, length: int = 9) -> float:
    """The runtime's logits at every position of random ids (a batch of 2) against transformers' own forward."""
    checkpoint = Checkpoint(made.path)
    stage = load_full_target(checkpoint)
    ids = torch.randint(0, SIZES["vocab_size"], (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = made.model(input_ids=ids).logits
        ours = stage.logits(stage(ids, torch.arange(length).expand(2, -1)))
    assert ours.shape == expected.shape
    return relative_error(ours, expected)


@pytest.mark.parametrize("architecture", list(TEXT))
def test_the_config_class_defaults_run_and_compute_transformers_logits(hub, architecture):
    made = hub(architecture)
    assert made.refusal is None
    checkpoint = Checkpoint(made.path)
    assert checkpoint.unrunnable_reason() is None
    assert checkpoint.layout == "index" and len({info.shard for info in checkpoint.tensors.values()}) >= 3
    assert logits_error(made) < 1e-4


def test_qwen3_5_moe_needs_no_dense_intermediate_size(hub):
    """transformers' Qwen3_5MoeTextConfig has no intermediate_size: every layer, the MTP layer too, is MoE."""
    made = hub("Qwen3_5MoeForCausalLM")
    assert "intermediate_size" not in made.written
    checkpoint = Checkpoint(made.path)
    config = checkpoint.config
    assert checkpoint.unrunnable_reason() is None and config.intermediate_size == 0
    assert all(config.is_moe_layer(layer) for layer in range(config.num_hidden_layers + 1))
    assert config.num_nextn_predict_layers == 1


@pytest.mark.parametrize("architecture", list(NESTED))
def test_a_multimodal_release_runs_its_nested_text_model(hub, architecture):
    made = hub(architecture)
    assert isinstance(made.written["text_config"], dict) and "vocab_size" not in made.written
    assert made.refusal is None
    checkpoint = Checkpoint(made.path)
    assert checkpoint.unrunnable_reason() is None
    assert checkpoint.config.decoder_prefix == "model.language_model."
    assert checkpoint.config.num_nextn_predict_layers == 1
    assert logits_error(made) < 1e-4
    load_full_target(checkpoint)  # the vision tower is there, and not read
    assert any(key.startswith("model.visual.") for key in checkpoint.tensors)
    assert checkpoint.keys_read and not any(key.startswith("model.visual.") for key in checkpoint.keys_read)


def test_a_nested_config_whose_tying_disagrees_is_refused(hub):
    written = hub("Qwen3_5ForConditionalGeneration").written
    text = {**written["text_config"], "tie_word_embeddings": False}
    config = read_config({**written, "text_config": text, "tie_word_embeddings": True})
    assert "tie_word_embeddings is True but text_config's is False" in config.runtime_refusal


@pytest.mark.parametrize("architecture", [*TEXT, "Qwen3_5MoeForConditionalGeneration"])
def test_check_runs_the_runtime_stages(hub, architecture):
    made = hub(architecture)
    drafter = ["--speculative-model", str(made.drafter)] if made.drafter else []
    args = ("check", "--model", str(made.path), "--pp", "2", "--max-tokens", "4", "--json", "-", *drafter)
    result = specdoctor(*args)
    assert result.returncode in (0, 1), result.stderr
    report = json.loads(result.stdout)
    assert not [f for f in report["preflight"] if f["check"] == "runtime.skipped"], report["preflight"]
    assert report["stages"] and report["stages"][0]["behaviour"], report["preflight"]
    provenance = report["stages"][0]["drafter"]["provenance"]  # every drafter tensor found where its layout says
    assert "unfilled:missing-from-checkpoint" not in provenance.values(), provenance


@pytest.mark.parametrize("architecture", NAMES_NO_ROUTER)
def test_an_unnamed_router_is_what_vllm_computes_differently(hub, architecture, tmp_path):
    """The config as transformers wrote it runs (above) and the pre-flight says vLLM routes it otherwise; named as
    the released configs name it, nothing is said; a router the architecture does not have is refused."""
    made = hub(architecture)

    def router_findings(path) -> list[dict]:
        result = specdoctor("inspect", "--model", str(path), "--json", "-")
        assert result.returncode == 0, result.stderr
        return [f for f in json.loads(result.stdout)["preflight"] if f["check"] == "config.router"]

    (finding,) = router_findings(made.path)
    assert finding["severity"] == "error" and finding["data"]["unnamed"] == ["scoring_func", "topk_method"]
    assert (
        "vLLM 0.32 routes this" in finding["message"] and "softmax scores and no correction bias" in finding["message"]
    )
    named = tmp_path / "named"
    shutil.copytree(made.path, named)
    config = json.loads((named / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**config, **ROUTER}))
    assert router_findings(named) == []
    (named / "config.json").write_text(json.dumps({**config, "scoring_func": "sigmoid"}))
    (one,) = router_findings(named)  # half named: vLLM's sigmoid then has no bias
    assert one["data"]["unnamed"] == ["topk_method"] and "with sigmoid scores and no correction bias" in one["message"]
    (named / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax", "topk_method": "greedy"}))
    assert "router ('softmax', 'greedy') is not supported" in Checkpoint(named).unrunnable_reason()
