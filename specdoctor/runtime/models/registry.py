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


FAMILIES = {glm4_moe.ARCHITECTURE: ModelFamily(glm4_moe.read_config, glm4_moe.DecoderLayer, glm4_moe.MtpLayer)}
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
