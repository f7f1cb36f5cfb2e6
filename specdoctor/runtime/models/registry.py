"""The model families the runtime runs, keyed by `architectures[0]` of config.json.

A family module declares its config mapping (`read_config`), its target decoder block and its MTP
layer; adding a family touches that module, this table and the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from specdoctor.errors import CheckpointError
from specdoctor.runtime.config import ModelConfig, RawConfig
from specdoctor.runtime.models import glm4_moe


@dataclass(frozen=True)
class ModelFamily:
    read_config: Callable[[RawConfig], ModelConfig]
    decoder_layer: type[nn.Module]  # a target block: (config, layer_id)
    mtp_layer: type[nn.Module]  # an MTP layer: (config, layer_id)
    # Whether vLLM's model builds the embedding on the last PP rank too when tie_word_embeddings is set
    # (Llama-style models do; GLM-4.5 MoE and DeepSeek ignore the flag): docs/engine-semantics.md §Ownership.
    tied_embedding_on_last_rank: bool
    # Whether vLLM's model refuses to build a PP rank whose layers hold no MoE layer (GLM-4.5 MoE: "No Glm4MoE
    # layer found in model.layers."): docs/engine-semantics.md §Ownership.
    needs_moe_layer_per_rank: bool


FAMILIES = {
    glm4_moe.ARCHITECTURE: ModelFamily(
        glm4_moe.read_config,
        glm4_moe.DecoderLayer,
        glm4_moe.MtpLayer,
        tied_embedding_on_last_rank=False,
        needs_moe_layer_per_rank=True,
    )
}
# config.json files without `architectures` are read as the first family's, as before.
DEFAULT_ARCHITECTURE = glm4_moe.ARCHITECTURE


def family_of(config: ModelConfig) -> ModelFamily:
    return FAMILIES[config.architecture]


def read_config(raw, source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a parsed config.json, by its family's mapping; validated."""
    fields = RawConfig(raw, source)
    architecture = fields.architecture or DEFAULT_ARCHITECTURE
    if architecture not in FAMILIES:
        supported = ", ".join(FAMILIES)
        raise CheckpointError(f"{source}: architecture {architecture!r} is not supported (supported: {supported})")
    config = FAMILIES[architecture].read_config(fields)
    config.validate(source)
    return config
