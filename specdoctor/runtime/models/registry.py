"""The model families the runtime runs, keyed by `architectures[0]` of config.json, and the config of
every architecture whose MTP layout is known (runtime/architectures.py), runnable or not.

A family module declares its config mapping (`read_config`), its target decoder block and its MTP
layer; adding a family touches that module, this table, runtime/architectures.py and the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import nn

from specdoctor.errors import CheckpointError
from specdoctor.runtime.architectures import ARCHITECTURES
from specdoctor.runtime.config import ModelConfig, MtpKeyLayout, RawConfig
from specdoctor.runtime.models import deepseek_v3, glm4_moe, llama, qwen3, qwen3_next
from specdoctor.runtime.models.layers import RMSNorm


@dataclass(frozen=True)
class ModelFamily:
    read_config: Callable[[RawConfig, str, MtpKeyLayout], ModelConfig]  # (fields, architecture, MTP layout)
    decoder_layer: type[nn.Module]  # a target block: (config, layer_id)
    mtp_layer: type[nn.Module] | None  # an MTP layer: (config, layer_id); None: the family has none
    norm: type[nn.Module] = RMSNorm  # the final norm: (size, eps)


FAMILIES = {
    glm4_moe.ARCHITECTURE: ModelFamily(glm4_moe.read_config, glm4_moe.DecoderLayer, glm4_moe.MtpLayer),
    qwen3.ARCHITECTURE: ModelFamily(qwen3.read_config, qwen3.DecoderLayer, None),
    llama.ARCHITECTURE: ModelFamily(llama.read_config, llama.DecoderLayer, None),
    **{
        architecture: ModelFamily(deepseek_v3.read_mla_config, deepseek_v3.DecoderLayer, deepseek_v3.MtpLayer)
        for architecture in deepseek_v3.ARCHITECTURES
    },
    **{
        architecture: ModelFamily(
            qwen3_next.read_config, qwen3_next.DecoderLayer, qwen3_next.MtpLayer, qwen3_next.OffsetRMSNorm
        )
        for architecture in (*qwen3_next.ARCHITECTURES, *qwen3_next.MULTIMODAL_ARCHITECTURES)
    },
}
# config.json files without `architectures` are read as the first family's, as before.
DEFAULT_ARCHITECTURE = glm4_moe.ARCHITECTURE
# Where a multimodal release whose config nests the text model under `text_config` keeps that model's weights.
NESTED_PREFIX = "model.language_model."


def family_of(config: ModelConfig) -> ModelFamily:
    return FAMILIES[config.architecture]


def is_runnable(config: ModelConfig) -> bool:
    return config.architecture in FAMILIES and not config.runtime_refusal


def read_config(raw, source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a parsed config.json, by its family's mapping (or, for an architecture the
    runtime cannot run, the fields the header-only commands need); validated."""
    fields = RawConfig(raw, source)
    architecture = fields.architecture or DEFAULT_ARCHITECTURE
    if architecture not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise CheckpointError(
            f"{source}: architecture {architecture!r} is not supported: its MTP layout is unknown (known: {known})"
        )
    nested = isinstance(raw.get("text_config"), dict)
    if nested:  # a multimodal checkpoint: the language model's fields, over the top level's others
        fields = RawConfig({**{k: v for k, v in raw.items() if k != "text_config"}, **raw["text_config"]}, source)
    layout = ARCHITECTURES[architecture].mtp
    if architecture not in FAMILIES:
        config = header_only_config(fields, architecture, layout)
    else:
        try:
            if nested:
                check_nested_tying(raw, source)
            config = FAMILIES[architecture].read_config(fields, architecture, layout)
        except CheckpointError as refusal:  # a setting the family does not run: the headers are still read
            config = header_only_config(fields, architecture, layout)
            config = replace(config, runtime_refusal=str(refusal).removeprefix(f"{source}: "))
    if nested:
        config = replace(config, decoder_prefix=NESTED_PREFIX)
    config.validate(source)
    return config


def check_nested_tying(raw: dict, source: str) -> None:
    """transformers ties a multimodal model's head by the top level's `tie_word_embeddings`; the text model read
    alone ties by text_config's. A config whose two disagree names two different models: refused."""
    top, text = raw.get("tie_word_embeddings"), raw["text_config"].get("tie_word_embeddings")
    if top is not None and text is not None and bool(top) != bool(text):
        raise CheckpointError(
            f"{source}: tie_word_embeddings is {top} but text_config's is {text}: one ties the head, the other not"
        )


def header_only_config(raw: RawConfig, architecture: str, layout: MtpKeyLayout) -> ModelConfig:
    """What inspect and the pre-flight need of an architecture the runtime cannot run: sizes, layers,
    the MTP layer count, tying; the compute fields are left neutral."""
    hidden, heads = raw.need("hidden_size"), int(raw.get("num_attention_heads") or 1)
    experts = int(raw.get("n_routed_experts") or raw.get("num_experts") or 0)
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw.need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=int(raw.get("intermediate_size") or 0),
        num_hidden_layers=raw.need("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rotary_dim=0,
        rope_theta=float(raw.get("rope_theta") or 10000.0),
        rms_norm_eps=float(raw.get("rms_norm_eps") or 1e-6),
        attention_bias=False,
        use_qk_norm=False,
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        n_routed_experts=experts,
        num_experts_per_tok=min(int(raw.get("num_experts_per_tok") or 1), max(experts, 1)),
        n_shared_experts=0,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        num_nextn_predict_layers=raw.mtp_layer_count(layout),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings") or 4096),
        eos_token_ids=raw.eos_token_ids(),
        mtp_keys=layout,
    )
