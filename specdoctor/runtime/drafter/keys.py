"""Every checkpoint-key rule about the drafter, once (docs/engine-semantics.md §MTP step and
§Drafter embedding and head under PP).

The drafter module's parameter names are `embed_tokens.weight` and `layers.{N}.…` for MTP layer N
(N counts on from the target's layers); where the checkpoint keeps an MTP layer's tensors, and its
optional own embedding and head, is the family's `MtpKeyLayout` (runtime/config.py).
"""

from __future__ import annotations

import torch

from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.models.registry import family_of, is_runnable

DRAFTER_EMBEDDING = "embed_tokens.weight"  # the drafter's parameter name
TARGET_EMBEDDING = "model.embed_tokens.weight"  # the target's parameter name
TARGET_HEAD = "lm_head.weight"
# Where checkpoints keep the target's token embedding, in order of preference.
TARGET_EMBEDDING_KEYS = (
    "model.language_model.embed_tokens.weight",
    TARGET_EMBEDDING,
    "model.embed.weight",
    "embed_tokens.weight",
    "model.word_embeddings.weight",
    "tok_embeddings.weight",
    "transformer.wte.weight",
)


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


def target_embedding_key(checkpoint: Checkpoint) -> str:
    """The target's embedding key: the first target candidate present (MTP layers' own copies excluded)."""
    return checkpoint.first_present(list(TARGET_EMBEDDING_KEYS)) or TARGET_EMBEDDING


def drafter_embedding_key(checkpoint: Checkpoint) -> str | None:
    """Where a correct loader reads the drafter's embedding: the first candidate present (an own copy
    before the target's), or None."""
    return checkpoint.first_present(embedding_candidates(checkpoint.config))


def target_head_key(checkpoint: Checkpoint) -> str:
    """The target's head: `lm_head.weight`, else the (tied) embedding."""
    return TARGET_HEAD if TARGET_HEAD in checkpoint.tensors else target_embedding_key(checkpoint)


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
    if name == DRAFTER_EMBEDDING:
        return drafter_embedding_key(checkpoint)
    key = drafter_layer_key(checkpoint.config, name)
    if key in checkpoint.tensors:
        return key
    if is_drafter_head(name):
        return target_head_key(checkpoint)
    return None


def target_key_for(checkpoint: Checkpoint):
    """name -> key for the target's parameters: the embedding (and a tied head) from the first candidate."""
    embedding = target_embedding_key(checkpoint)
    tied = checkpoint.config.tie_word_embeddings

    def key_for(name: str) -> str:
        if name == TARGET_EMBEDDING or (tied and name == TARGET_HEAD):
            return embedding
        return name

    return key_for


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
