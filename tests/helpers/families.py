"""Tiny checkpoints of every architecture vLLM 0.32 registers an MTP drafter for, saved by transformers'
own classes in several shards, with MTP tensors appended the way the hub checkpoints lay them out
(transformers does not save MTP layers): an MTP layer is one more decoder block of the family plus
the layout's own tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.conftest import TINY, randomize

# TINY's sizes; MLA families derive their head sizes from the fields below; the others get head_dim 16
SHARED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
SMALL = {name: TINY[name] for name in SHARED} | {"max_position_embeddings": 256}
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
MLA = dict(
    MOE, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
)  # fmt: skip
LINEAR = dict(
    head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
)
QWEN_MOE = dict(MOE, num_experts=4, shared_expert_intermediate_size=32, **LINEAR)

# name: (transformers config class, model class, config fields, MTP count field written to config.json)
FAMILIES = {
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", "DeepseekV3ForCausalLM", MLA, "num_nextn_predict_layers"),
    "DeepseekV32ForCausalLM": ("DeepseekV32Config", "DeepseekV32ForCausalLM", MLA, "num_nextn_predict_layers"),
    "Glm4MoeLiteForCausalLM": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", MLA, "num_nextn_predict_layers"),
    "GlmMoeDsaForCausalLM": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", MLA, "num_nextn_predict_layers"),
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN_MOE, "num_nextn_predict_layers"),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", QWEN_MOE, "mtp_num_hidden_layers"),
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", LINEAR, "mtp_num_hidden_layers"),
    "MiMoV2FlashForCausalLM": (
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        dict(MOE, n_routed_experts=4),
        "num_nextn_predict_layers",
    ),  # fmt: skip
}


def saved_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` as transformers saved them (the hub layout: experts one by one)."""
    out = {}
    for shard in path.glob("*.safetensors"):
        out |= {key: value for key, value in load_file(str(shard)).items() if key.startswith(prefix)}
    return out


# Fields the hub configs carry that transformers' config classes leave out: vLLM builds these with DeepSeek-V2's
# MoE, which needs them to route as transformers does (sigmoid scores with the correction bias).
HUB_CONFIG_FIELDS = {
    architecture: {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    for architecture in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
}
# DeepSeek's hub checkpoints ship each MTP layer's own copies of the embedding and the head, equal to the
# target's (model.layers.61.embed_tokens, .shared_head.head); GLM-5's ship neither.
SHIPS_OWN_COPIES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


def mtp_tensors(architecture: str, path: Path, config) -> dict[str, torch.Tensor]:
    """One MTP layer in the hub layout: the family's last decoder block as saved, renamed, the layout's
    own tensors (random; norms near 1) and, where the family ships them, the copies of the target's
    embedding and head."""
    from specdoctor.runtime.architectures import ARCHITECTURES

    layout = ARCHITECTURES[architecture].mtp
    last = f"model.layers.{config.num_hidden_layers - 1}."
    layer = config.num_hidden_layers if layout.numbered_after_target else 0
    prefix = layout.prefix(layer)
    generator = torch.Generator().manual_seed(7)
    hidden = config.hidden_size
    out = {prefix + key[len(last) :]: value.clone() for key, value in saved_tensors(path, last).items()}
    for key in (*(prefix + name for name in layout.layer_keys), *layout.shared_keys):
        projection = key.endswith(("eh_proj.weight", "input_proj.weight", "fc.weight"))
        noise = torch.randn((hidden, 2 * hidden) if projection else (hidden,), generator=generator)
        out[key] = 1 + 0.2 * noise if "norm" in key else 0.15 * noise
    if architecture in SHIPS_OWN_COPIES:
        target = saved_tensors(path, "model.embed_tokens.") | saved_tensors(path, "lm_head.")
        out[prefix + layout.own_embedding] = target["model.embed_tokens.weight"].clone()
        out[prefix + layout.own_head] = target["lm_head.weight"].clone()
    return out


def make_family_checkpoint(path: Path, architecture: str, seed: int = 0, **overrides):
    """Save a random tiny `architecture` with transformers (several shards + index), append its MTP layer
    in the hub layout and name the MTP layer count (and the router, where vLLM needs it) in config.json as
    the hub configs do. Returns the transformers model."""
    import transformers

    config_class, model_class, fields, count_field = FAMILIES[architecture]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**SMALL, **fields, **overrides})
    model = getattr(transformers, model_class)(config).eval()
    randomize(model, seed)
    model.save_pretrained(path, max_shard_size="100KB")
    tensors = mtp_tensors(architecture, path, config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model-mtp.safetensors"))
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
    index_path.write_text(json.dumps(index))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **HUB_CONFIG_FIELDS.get(architecture, {}), count_field: 1}))
    return model


def checkpoints_by_architecture(tmp_path_factory, architectures, make=make_family_checkpoint) -> dict:
    """{architecture: (directory, transformers model)}, one tiny checkpoint each (a module fixture's body)."""
    made = {}
    for architecture in architectures:
        path = tmp_path_factory.mktemp(architecture)
        made[architecture] = path, make(path, architecture)
    return made


# Prompts of different lengths in one batch, for the pipeline tests of every family.
PIPELINE_PROMPTS = [[5, 9, 14, 3, 77, 41, 8, 19], [101, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20]]


def plain_greedy(path, model) -> tuple[list[list[int]], torch.Tensor]:
    """(single-process greedy tokens for PIPELINE_PROMPTS, cut at the config's EOS as the engine stops there;
    the prompt logits). The configs keep transformers' default EOS."""
    from tests.runtime.test_engine import reference

    greedy, logits = reference(path, PIPELINE_PROMPTS, 12)
    eos = model.config.eos_token_id
    return [tokens[: tokens.index(eos)] if eos in tokens else tokens for tokens in greedy], logits


def assert_pipeline_matches_single_process(path, model, pp: int, ks) -> None:
    """At PP `pp`: prompt logits and plain greedy tokens equal the single process's, and speculative decoding
    with each k in `ks` gives the same tokens (lossless) with every draft counted."""
    from specdoctor.runtime.engine import Engine
    from specdoctor.runtime.options import RuntimeOptions

    expected_tokens, expected_logits = plain_greedy(path, model)
    with Engine(RuntimeOptions(str(path), pp=pp, timeout=60)) as engine:
        logits = engine.prompt_logits(PIPELINE_PROMPTS)
        for row, prompt in enumerate(PIPELINE_PROMPTS):
            n = len(prompt)
            torch.testing.assert_close(logits[row, :n], expected_logits[row, :n], rtol=1e-4, atol=1e-5)
        assert engine.generate(PIPELINE_PROMPTS, 12).tokens == expected_tokens
        for k in ks:
            result = engine.generate(PIPELINE_PROMPTS, 12, num_speculative_tokens=k)
            assert result.tokens == expected_tokens, k
            assert result.metrics.num_draft_tokens == k * result.metrics.num_drafts > 0


def save_dense_checkpoint(path, architecture: str, seed: int = 0, **overrides):
    """transformers' dense `architecture` (Qwen3ForCausalLM, LlamaForCausalLM) at SMALL sizes with random weights,
    saved in several shards; the model."""
    import transformers

    from tests.conftest import randomize

    config_class = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config_class(**{**SMALL, "head_dim": 16, **overrides})).eval()
    randomize(model, seed)
    model.save_pretrained(path, max_shard_size="100KB")
    return model
