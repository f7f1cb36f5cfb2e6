"""Which kind of drafter drafts for a target: a drafter checkpoint of its own where one is asked for (or a
demo brings one), else the target's own MTP layers, else none. Adding a kind: its module, a line here."""

from __future__ import annotations

from specdoctor.errors import CheckpointError
from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS, DEMO_MODELS, resolve_model_path
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.drafter.checkpoint import DrafterCheckpoint
from specdoctor.runtime.drafter.draft_model import DraftModelKind
from specdoctor.runtime.drafter.dspark import DSparkKind
from specdoctor.runtime.drafter.eagle3 import Eagle3Kind
from specdoctor.runtime.drafter.kind import DEFAULT_SPECULATIVE_TOKENS, DrafterKind
from specdoctor.runtime.drafter.mtp import MtpKind
from specdoctor.runtime.models.eagle3 import Eagle3Config
from specdoctor.runtime.options import RuntimeOptions


def drafter_checkpoint_path(model: str, speculative_model: str | None) -> str | None:
    """The drafter checkpoint to open: the one asked for, else the one a demo model brings (named, or by its
    directory), else None."""
    if speculative_model is not None:
        return speculative_model
    if model in DEMO_DRAFTERS:  # named: demo-dspark and demo-eagle3 share a target directory
        return str(DEMO_DRAFTERS[model])
    path = resolve_model_path(model)
    found = next(
        (DEMO_DRAFTERS[name] for name, demo in DEMO_MODELS.items() if demo == path and name in DEMO_DRAFTERS), None
    )
    return str(found) if found else None


def kind_of(config) -> type[DrafterKind]:
    """The kind of a drafter checkpoint, by the config it was read as."""
    if isinstance(config, Eagle3Config):
        return Eagle3Kind
    return DraftModelKind if isinstance(config, ModelConfig) else DSparkKind


def drafter_kind(
    target: Checkpoint, model: str, speculative_model: str | None, method: str | None = None
) -> DrafterKind | None:
    """The drafter of this deployment, its headers read but not judged (the pre-flight describes even a
    drafter the runtime refuses); None when the target has nothing to draft with. `method`, where the user
    named one (vLLM's "method"), must be the kind the checkpoint is."""
    path = drafter_checkpoint_path(model, speculative_model)
    kind = None
    if path is not None:
        drafter = DrafterCheckpoint(path, method)
        kind = kind_of(drafter.config)(target, drafter)
    elif target.config.num_nextn_predict_layers:
        kind = MtpKind(target)
    if method is not None and method != (kind.name if kind else "mtp"):
        found = (
            f"{kind.path or target.path}: the drafter is the {kind.label} (method {kind.name!r})"
            if kind
            else f"{target.path}: no drafter (the target has no MTP layers and no drafter checkpoint was given)"
        )
        raise CheckpointError(f"{found}, not method {method!r} as --speculative-config says")
    return kind


def speculative_tokens(drafter: DrafterKind | None, asked: int | None) -> int:
    """The draft tokens a step takes: what the user asked for, else the drafter kind's default."""
    if asked is not None:
        return asked
    return drafter.default_speculative_tokens() if drafter else DEFAULT_SPECULATIVE_TOKENS


def open_drafter(target: Checkpoint, options: RuntimeOptions) -> DrafterKind | None:
    """The drafter of the deployment `options` describe, checked against its target and runnable by the runtime."""
    kind = drafter_kind(target, options.model, options.speculative_model, options.speculative_method)
    if kind is not None:
        kind.require_runnable()
    return kind
