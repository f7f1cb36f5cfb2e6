"""A block drafter (DSpark) beside its target: which drafter checkpoint is opened, whether the pair can run
(docs/dspark.md §The checkpoint), and how many drafts a step takes when the user does not say."""

from __future__ import annotations

from specdoctor.errors import CheckpointError
from specdoctor.runtime.checkpoint import Checkpoint, DrafterCheckpoint, drafter_checkpoint_path
from specdoctor.runtime.models.dspark import pairing_problems

DEFAULT_SPECULATIVE_TOKENS = 3  # check's k for an MTP drafter, or a block drafter that names no block size


def open_block_drafter(model: str, speculative_model: str | None, target: Checkpoint) -> DrafterCheckpoint | None:
    """The drafter checkpoint for this target (asked for, or the one a demo brings), checked against the
    target and runnable by the runtime; None for a target that drafts with its own MTP layers or not at all."""
    path = drafter_checkpoint_path(model, speculative_model)
    if path is None:
        return None
    drafter = DrafterCheckpoint(path)
    if target.config.num_nextn_predict_layers:
        raise CheckpointError(
            f"{target.path}: the target has its own MTP layers; a drafter checkpoint ({drafter.path}) is not run "
            "beside them"
        )
    problems = pairing_problems(drafter.config, target.config)
    if problems:
        raise CheckpointError(f"{drafter.path}: cannot draft for {target.path}: {problems[0]}")
    drafter.require_runnable()
    return drafter


def default_speculative_tokens(drafter: DrafterCheckpoint | None) -> int:
    """vLLM's default for a DSpark drafter is its block size; check's default otherwise."""
    block = drafter.config.block_size if drafter else None
    return block or DEFAULT_SPECULATIVE_TOKENS
