"""Which kind of drafter drafts for a target: a drafter checkpoint of its own where one is asked for (or a
demo brings one), else the target's own MTP layers, else none. Adding a kind: its module, a line here."""

from __future__ import annotations

from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS, DEMO_MODELS, resolve_model_path
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.checkpoint import DrafterCheckpoint
from specdoctor.runtime.drafter.dspark import DSparkKind
from specdoctor.runtime.drafter.eagle3 import Eagle3Kind
from specdoctor.runtime.drafter.kind import DEFAULT_SPECULATIVE_TOKENS, DrafterKind
from specdoctor.runtime.drafter.mtp import MtpKind
from specdoctor.runtime.models.eagle3 import Eagle3Config


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


def drafter_kind(target: Checkpoint, model: str, speculative_model: str | None) -> DrafterKind | None:
    """The drafter of this deployment, its headers read but not judged (the pre-flight describes even a
    drafter the runtime refuses); None when the target has nothing to draft with."""
    path = drafter_checkpoint_path(model, speculative_model)
    if path is not None:
        drafter = DrafterCheckpoint(path)
        return (Eagle3Kind if isinstance(drafter.config, Eagle3Config) else DSparkKind)(target, drafter)
    if target.config.num_nextn_predict_layers:
        return MtpKind(target)
    return None


def speculative_tokens(drafter: DrafterKind | None, asked: int | None) -> int:
    """The draft tokens a step takes: what the user asked for, else the drafter kind's default."""
    if asked is not None:
        return asked
    return drafter.default_speculative_tokens() if drafter else DEFAULT_SPECULATIVE_TOKENS


def open_drafter(target: Checkpoint, model: str, speculative_model: str | None) -> DrafterKind | None:
    """The drafter of this deployment, checked against its target and runnable by the runtime."""
    kind = drafter_kind(target, model, speculative_model)
    if kind is not None:
        kind.require_runnable()
    return kind
