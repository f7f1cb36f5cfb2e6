"""Which kind of drafter drafts for a target, chosen here once: a drafter checkpoint of its own where one is
asked for (or a demo brings one), the kind that claims its config.json; else the target's own MTP layers; else
none. Adding a kind: its module, a line in KINDS."""

from __future__ import annotations

from specdoctor.errors import CheckpointError, SpecdoctorError
from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS, DEMO_MODELS, resolve_model_path
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.checkpoint import DrafterCheckpoint, OwnCheckpointKind
from specdoctor.runtime.drafter.draft_model import DraftModelKind
from specdoctor.runtime.drafter.dspark import DSparkKind
from specdoctor.runtime.drafter.eagle3 import Eagle3Kind
from specdoctor.runtime.drafter.kind import DEFAULT_SPECULATIVE_TOKENS, DrafterKind
from specdoctor.runtime.drafter.mtp import MtpKind
from specdoctor.runtime.options import RuntimeOptions

# Every kind, in the order messages list them; the kinds of a checkpoint of their own claim its config in
# this order too (the first that claims it is its kind).
KINDS: tuple[type[DrafterKind], ...] = (MtpKind, DSparkKind, Eagle3Kind, DraftModelKind)
CHECKPOINT_KINDS: tuple[type[OwnCheckpointKind], ...] = tuple(k for k in KINDS if issubclass(k, OwnCheckpointKind))


def kind_named(method: str) -> type[DrafterKind]:
    """The kind vLLM's `method` names (every MTP name means the target's MTP layers)."""
    found = next((kind for kind in KINDS if method in kind.methods()), None)
    if found is None:
        raise SpecdoctorError(
            f"--speculative-method: unknown method {method!r} (choose from {', '.join(k.name for k in KINDS)})"
        )
    return found


def speculative_method(method: str | None) -> str | None:
    """The name of the kind `method` names, as RuntimeOptions holds it; None stays None (read from the checkpoint)."""
    return None if method is None else kind_named(method).name


def drafter_checkpoint(path, method: str | None = None) -> DrafterCheckpoint:
    """A drafter checkpoint, its config read as the kind that claims it (or the one `method` names) reads it."""
    return DrafterCheckpoint(path, CHECKPOINT_KINDS, method)


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


def drafter_kind(
    target: Checkpoint, model: str, speculative_model: str | None, method: str | None = None
) -> DrafterKind | None:
    """The drafter of this deployment, its headers read but not judged (the pre-flight describes even a
    drafter the runtime refuses); None when the target has nothing to draft with. `method`, where the user
    named one (vLLM's "method"), must be the kind the checkpoint is."""
    method = speculative_method(method)
    path = drafter_checkpoint_path(model, speculative_model)
    kind = None
    if path is not None:
        drafter = drafter_checkpoint(path, method)
        kind = drafter.kind(target, drafter)
    elif target.config.num_nextn_predict_layers:
        kind = MtpKind(target)
    if method is not None and method != (kind.name if kind else MtpKind.name):
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


def options_from_speculative_config(text: str) -> dict:
    """RuntimeOptions fields from vLLM's `--speculative-config` JSON: num_speculative_tokens, and, if given,
    draft_sample_method, the method as given (speculative_method reads vLLM's MTP names as the MTP kind's) and
    the drafter checkpoint ("model", with the method of a kind of CHECKPOINT_KINDS, or none: the checkpoint
    tells its kind). Keys the runtime cannot honour are refused, not ignored."""
    import json

    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpecdoctorError(f"--speculative-config is not valid JSON ({err.msg})") from None
    if not isinstance(config, dict):
        raise SpecdoctorError("--speculative-config must be a JSON object")
    unknown = sorted(set(config) - {"method", "model", "num_speculative_tokens", "draft_sample_method"})
    if unknown:
        raise SpecdoctorError(
            f"--speculative-config: {', '.join(unknown)} not supported (specdoctor reads method, model, "
            "num_speculative_tokens and draft_sample_method)"
        )
    # Without a method vLLM tells a drafter checkpoint's kind from it, and drafts with MTP layers without one.
    method = config.get("method", MtpKind.name if "model" not in config else None)
    checkpoint_methods = [name for kind in CHECKPOINT_KINDS for name in kind.methods()]
    if method is not None and method not in (*MtpKind.methods(), *checkpoint_methods):
        raise SpecdoctorError(
            f"--speculative-config: method {method!r} is not run (MTP methods: {', '.join(MtpKind.methods())}; "
            f"drafter checkpoints: {', '.join(checkpoint_methods)})"
        )
    if method is not None and (method in checkpoint_methods) != ("model" in config):
        raise SpecdoctorError(
            f"--speculative-config: method {method!r} "
            + ("needs" if method in checkpoint_methods else "takes no")
            + ' "model" (DSpark, EAGLE-3 and draft models are checkpoints of their own; an MTP drafter is the '
            "target's)"
        )
    k = config.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int):
        raise SpecdoctorError("--speculative-config: num_speculative_tokens must be an integer")
    fields = {"num_speculative_tokens": k}
    if "method" in config:
        fields["speculative_method"] = method
    if "model" in config:
        fields["speculative_model"] = str(config["model"])
    if "draft_sample_method" in config:
        fields["draft_sample_method"] = config["draft_sample_method"]  # checked by RuntimeOptions
    return fields
