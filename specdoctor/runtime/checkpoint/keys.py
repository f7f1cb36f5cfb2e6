"""Where checkpoints keep the target's tensors: the token embedding under its candidate keys (in order of
preference), the head (or the tied embedding), and the name -> key rule the target loader uses."""

from __future__ import annotations

from specdoctor.runtime.checkpoint.reader import Checkpoint

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


def target_embedding_key(checkpoint: Checkpoint) -> str:
    """The target's embedding key: the first target candidate present (MTP layers' own copies excluded)."""
    return checkpoint.first_present(list(TARGET_EMBEDDING_KEYS)) or TARGET_EMBEDDING


def target_head_key(checkpoint: Checkpoint) -> str:
    """The target's head: `lm_head.weight`, else the (tied) embedding."""
    return TARGET_HEAD if TARGET_HEAD in checkpoint.tensors else target_embedding_key(checkpoint)


def target_key_for(checkpoint: Checkpoint):
    """name -> key for the target's parameters: the embedding (and a tied head) from the first candidate; the
    other `model.*` tensors under the config's decoder prefix (`model.language_model.` where it nests)."""
    embedding = target_embedding_key(checkpoint)
    tied = checkpoint.config.tie_word_embeddings
    prefix = checkpoint.config.decoder_prefix

    def key_for(name: str) -> str:
        if name == TARGET_EMBEDDING or (tied and name == TARGET_HEAD):
            return embedding
        return prefix + name.removeprefix("model.") if name.startswith("model.") else name

    return key_for
