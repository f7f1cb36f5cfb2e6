"""The MTP drafter kind: the target's own MTP layers, run on the last rank (docs/engine-semantics.md §MTP
step and §Drafter embedding and head under PP). Every checkpoint-key rule about them, once, and their loading.

The drafter module's parameter names are `embed_tokens.weight` and `layers.{N}.…` for MTP layer N
(N counts on from the target's layers); where the checkpoint keeps an MTP layer's tensors, and its
optional own embedding and head, is the family's `MtpKeyLayout` (runtime/config.py).
"""

from __future__ import annotations

import torch

from specdoctor.runtime.checkpoint.keys import TARGET_EMBEDDING_KEYS, target_head_key
from specdoctor.runtime.checkpoint.loader import allocate, load_module, materialize
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.drafter.kind import EMBEDDING, DrafterKind
from specdoctor.runtime.drafter.policy import Placer, Provenance, Source
from specdoctor.runtime.models.mtp import MtpDrafter
from specdoctor.runtime.models.registry import family_of, is_runnable
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import HeadPolicy, RuntimeOptions


def own_embedding_key(config: ModelConfig, layer_id: int) -> str | None:
    """The MTP layer's own copy of the embedding, where the layout has one (a checkpoint may still omit it)."""
    own = config.mtp_keys.own_embedding
    return config.mtp_keys.prefix(layer_id) + own if own else None


def own_head_key(config: ModelConfig, layer_id: int) -> str | None:
    own = config.mtp_keys.own_head
    return config.mtp_keys.prefix(layer_id) + own if own else None


def drafter_head_name(layer_id: int) -> str:
    """The drafter parameter of MTP layer `layer_id`'s head."""
    return f"layers.{layer_id}.shared_head.head.weight"


def is_drafter_head(name: str) -> bool:
    return name.startswith("layers.") and name.endswith(".shared_head.head.weight")


def own_embedding_keys(config: ModelConfig) -> list[str]:
    return [key for i in config.mtp_layer_ids if (key := own_embedding_key(config, i))]


def embedding_candidates(config: ModelConfig) -> list[str]:
    """Keys that can supply the drafter's embedding, in the order a correct loader tries them: the MTP
    layer's own copy where the checkpoint ships one (it may differ from the target's), then the target's."""
    return [*own_embedding_keys(config), *TARGET_EMBEDDING_KEYS]


def drafter_embedding_key(checkpoint: Checkpoint) -> str | None:
    """Where a correct loader reads the drafter's embedding: the first candidate present (an own copy
    before the target's), or None."""
    return checkpoint.first_present(embedding_candidates(checkpoint.config))


def drafter_layer_key(config: ModelConfig, name: str) -> str | None:
    """Checkpoint key of a drafter parameter of an MTP layer (`layers.{N}.…`); None for the embedding."""
    if not name.startswith("layers."):
        return None
    layer, rest = name.removeprefix("layers.").split(".", 1)
    layout = config.mtp_keys
    if layout.shared_prefix + rest in layout.shared_keys:  # a part the drafter holds once (Qwen's mtp.fc, ...)
        return layout.shared_prefix + rest
    return layout.prefix(int(layer)) + rest


def expected_key(checkpoint: Checkpoint, name: str) -> str | None:
    """The checkpoint key a correctly loaded drafter parameter equals: the MTP layer's own tensor where
    the checkpoint ships one (embedding and head included), else the target's embedding or head."""
    if name == EMBEDDING:
        return drafter_embedding_key(checkpoint)
    key = drafter_layer_key(checkpoint.config, name)
    if key in checkpoint.tensors:
        return key
    if is_drafter_head(name):
        return target_head_key(checkpoint)
    return None


def expected_mtp_keys(config: ModelConfig, layer_id: int) -> list[str]:
    """Every key of its own an MTP layer needs: for a family the runtime runs, from its module itself (built on the meta
    device: no memory); for another, the layout's own keys (its decoder block is not known in detail)."""
    if not is_runnable(config):
        return [config.mtp_keys.prefix(layer_id) + name for name in config.mtp_keys.layer_keys]
    with torch.device("meta"):
        layer = family_of(config).mtp_layer(config, layer_id)
    names = [f"layers.{layer_id}.{name}" for name in layer.state_dict()]
    # The shared parts are checked once (pre-flight's shared tensors); a layout without an own head takes lm_head.
    keys = [drafter_layer_key(config, name) for name in names if config.mtp_keys.own_head or not is_drafter_head(name)]
    return [key for key in keys if key not in config.mtp_keys.shared_keys]


class MtpKind(DrafterKind):
    """The target's own MTP layers (DeepSeek-V3 / GLM / Qwen3.5 / MiMo layouts), on the last rank."""

    name = "mtp"
    # vLLM's MTP method names (vllm/config/speculative.py: MTPModelTypes): all mean the target's MTP layers.
    aliases = (
        "deepseek_mtp",
        "glm4_moe_mtp",
        "glm4_moe_lite_mtp",
        "glm5_next_mtp",
        "qwen3_next_mtp",
        "qwen3_5_mtp",
        "mimo_mtp",
        "mimo_v2_mtp",
    )
    label = "MTP layers"
    stats_parts = ("embed_tokens", "shared_head.head", "shared_head.norm", "eh_proj", "enorm", "hnorm")

    def embedding_candidates(self) -> list[str]:
        return embedding_candidates(self.target.config)

    def module(self) -> MtpDrafter:
        return MtpDrafter(self.target.config)

    def expected_source(self, name: str) -> Source | None:
        key = expected_key(self.target, name)
        return None if key is None else (self.target, key)

    def build(self, stage: TargetStage, options: RuntimeOptions, device: torch.device) -> tuple[MtpDrafter, Provenance]:
        checkpoint, config = self.target, self.target.config
        lazy = any(source.map_weights for source in self.checkpoints)
        drafter = allocate(self.module, options.dtype.torch(), device, lazy)
        provenance = Provenance()
        body = load_module(
            drafter, checkpoint, lambda name: None if is_drafter_head(name) else drafter_layer_key(config, name)
        )
        provenance.read(body.filled, lambda name: drafter_layer_key(config, name))
        provenance.missing(body.missing)
        place = Placer(drafter, stage, options, provenance, device)
        own = checkpoint.first_present(own_embedding_keys(config))
        target = checkpoint.first_present(list(TARGET_EMBEDDING_KEYS))
        place.embedding(own and (checkpoint, own), target and (checkpoint, target), own_copy_first=False)
        policy = options.head_policy
        if policy == HeadPolicy.ENGINE_LEGACY and config.mtp_keys.own_head is None:
            policy = HeadPolicy.FIXED  # a layout without an own head (Qwen's mtp.*): every engine loads lm_head
        for layer_id in config.mtp_layer_ids:
            own_head = own_head_key(config, layer_id)
            own_source = (checkpoint, own_head) if own_head in checkpoint.tensors else None
            module = drafter_head_name(layer_id).removesuffix(".weight")
            place.head(module, own_source, (checkpoint, target_head_key(checkpoint)), policy)
        materialize(drafter, device)
        return drafter.eval(), provenance
