"""Tiny checkpoints of every architecture vLLM 0.32 registers an MTP drafter for, saved by transformers'
own classes in several shards, with MTP tensors appended the way the hub checkpoints lay them out
(transformers does not save MTP layers): an MTP layer is one more decoder block of the family plus
the layout's own tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
MLA = dict(
    MOE, n_routed_experts=8, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
)  # fmt: skip
LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
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


def mtp_tensors(architecture: str, state: dict, config) -> dict[str, torch.Tensor]:
    """One MTP layer in the hub layout: the family's last decoder block renamed, plus the layout's tensors."""
    from specdoctor.runtime.architectures import ARCHITECTURES

    layout = ARCHITECTURES[architecture].mtp
    last = f"model.layers.{config.num_hidden_layers - 1}."
    layer = config.num_hidden_layers if layout.numbered_after_target else 0
    prefix = layout.prefix(layer)
    generator = torch.Generator().manual_seed(7)
    hidden, vocab = config.hidden_size, config.vocab_size
    out = {prefix + key[len(last) :]: value.clone() for key, value in state.items() if key.startswith(last)}
    shapes = {"eh_proj.weight": (hidden, 2 * hidden), "input_proj.weight": (hidden, 2 * hidden)}
    shapes |= {"shared_head.head.weight": (vocab, hidden), "embed_tokens.weight": (vocab, hidden)}
    for name in (*layout.layer_keys, *(k for k in (layout.own_head,) if k)):
        out[prefix + name] = torch.randn(shapes.get(name, (hidden,)), generator=generator)
    for key in layout.shared_keys:
        out[key] = torch.randn((hidden, 2 * hidden) if key.endswith("fc.weight") else (hidden,), generator=generator)
    return out


def make_family_checkpoint(path: Path, architecture: str, seed: int = 0):
    """Save a random tiny `architecture` with transformers (several shards + index), append its MTP layer
    in the hub layout and name the MTP layer count in config.json as the hub configs do."""
    import transformers

    config_class, model_class, fields, count_field = FAMILIES[architecture]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**SMALL, **fields})
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(path, max_shard_size="100KB")
    tensors = mtp_tensors(architecture, model.state_dict(), config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model-mtp.safetensors"))
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
    index_path.write_text(json.dumps(index))
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, count_field: 1}))
    return model
