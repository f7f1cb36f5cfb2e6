"""How a DSpark drafter (a checkpoint of its own) gets its weights, correctly or the ways engines got it
wrong (docs/dspark.md §Loading under PP). Its own tensors come from the drafter checkpoint; its embedding
and head are the target's unless it ships them, and under PP the target's embedding lives on the first
rank while the drafter runs on the last.

Embedding policies (--drafter-policy):
  fixed             the drafter's own copy; else the target's embedding where it is materialised on this rank,
                    else the one tensor read from the target checkpoint (the seed PR's fix, which it validated on
                    DSpark too). vLLM 0.32 instead refuses at PP > 1 ("needs the target input embedding, but it
                    is unavailable on this PP stage": eagle/utils.py maybe_share_target_embed).
  engine-legacy     share only when PP size is 1, else leave it as allocated: the vllm-backport fork before the
                    seed's PR #50 ("skips embedding sharing wholesale whenever pp world_size != 1").
  alias-placeholder share without checking that the target's embedding is materialised: a PPMissingLayer.
Head policies (--head-policy): fixed and engine-legacy load the own lm_head, else share the target's, which
the drafter's rank always holds (vLLM 0.32 shares it at any PP size); unloaded leaves it as allocated.
Markov policy (--markov-policy): unloaded leaves markov_w1 and markov_w2 as allocated (the fill).
"""

from __future__ import annotations

import torch

from specdoctor.errors import CheckpointError
from specdoctor.runtime.checkpoint.files import DEMO_DRAFTERS, DEMO_MODELS, resolve_model_path
from specdoctor.runtime.checkpoint.keys import target_embedding_key, target_head_key
from specdoctor.runtime.checkpoint.loader import allocate, load_module
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.policy import Provenance, fill_unloaded, has_real_weight
from specdoctor.runtime.models.dspark import DSparkDrafter, pairing_problems, read_dspark_config
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import EmbeddingPolicy, HeadPolicy, MarkovPolicy, RuntimeOptions

EMBEDDING, HEAD = "embed_tokens.weight", "lm_head.weight"  # parameters the target supplies unless shipped
MARKOV = "markov_head."
CONFIDENCE = "confidence_head."


def expected_source(drafter: DrafterCheckpoint, target: Checkpoint, name: str) -> tuple[Checkpoint, str]:
    """The checkpoint tensor a correctly loaded DSpark parameter equals: the drafter's own, else (embedding
    and head) the target's."""
    if name in drafter.tensors or name not in (EMBEDDING, HEAD):
        return drafter, name
    return target, target_embedding_key(target) if name == EMBEDDING else target_head_key(target)


def build_dspark_drafter(
    drafter_checkpoint: DrafterCheckpoint,
    target_checkpoint: Checkpoint,
    target: TargetStage,
    options: RuntimeOptions,
    device: torch.device,
) -> tuple[DSparkDrafter, Provenance]:
    """The drafter on the last rank, loaded the way `options` says; `target` is that rank's stage."""
    config = drafter_checkpoint.config
    drafter = allocate(lambda: DSparkDrafter(config), options.dtype.torch(), device)
    if config.confidence_head and not any(key.startswith(CONFIDENCE) for key in drafter_checkpoint.tensors):
        del drafter.confidence_head  # vLLM drops a configured head the checkpoint does not ship
    provenance = Provenance()
    markov_unloaded = options.markov_policy == MarkovPolicy.UNLOADED

    def own_key(name: str) -> str | None:
        skipped = name in (EMBEDDING, HEAD) or (markov_unloaded and name.startswith(MARKOV))
        return None if skipped else name

    body = load_module(drafter, drafter_checkpoint, own_key)
    provenance.sources.update({name: f"checkpoint:{name}" for name in body.filled})
    provenance.sources.update({name: "unfilled:missing-from-checkpoint" for name in body.missing})
    stale = target.lm_head.weight if has_real_weight(target.lm_head) else None
    if markov_unloaded:
        for name, parameter in drafter.markov_head.named_parameters(prefix=MARKOV.rstrip(".")):
            fill_unloaded(parameter, options.fill, stale)
            provenance.sources[name] = f"unfilled:{options.fill}"
    place_embedding(drafter, drafter_checkpoint, target_checkpoint, target, options, provenance, stale)
    place_head(drafter, drafter_checkpoint, target_checkpoint, target, options, provenance)
    return drafter.eval(), provenance


def place_embedding(drafter, own: DrafterCheckpoint, target_checkpoint, target, options, provenance, stale) -> None:
    policy, target_embedding = options.drafter_policy, target.model.embed_tokens
    if EMBEDDING in own.tensors:
        load_module(drafter.embed_tokens, own, lambda _name: EMBEDDING)
        provenance.sources[EMBEDDING] = f"checkpoint:{EMBEDDING}"
        return
    legacy_sharing = policy == EmbeddingPolicy.ENGINE_LEGACY and options.pp == 1
    fixed_sharing = policy == EmbeddingPolicy.FIXED and has_real_weight(target_embedding)
    if policy == EmbeddingPolicy.ALIAS_PLACEHOLDER or legacy_sharing or fixed_sharing:
        drafter.embed_tokens = target_embedding
        real = has_real_weight(target_embedding)
        provenance.sources[EMBEDDING] = "alias:model.embed_tokens" if real else "placeholder:model.embed_tokens"
    elif policy == EmbeddingPolicy.FIXED:
        key = target_embedding_key(target_checkpoint)
        load_module(drafter.embed_tokens, target_checkpoint, lambda _name: key)
        provenance.sources[EMBEDDING] = f"checkpoint:{key}"
    else:
        fill_unloaded(drafter.embed_tokens.weight, options.fill, stale)
        provenance.sources[EMBEDDING] = f"unfilled:{options.fill}"


def place_head(drafter, own: DrafterCheckpoint, target_checkpoint, target, options, provenance) -> None:
    if options.head_policy == HeadPolicy.UNLOADED:
        source = drafter.embed_tokens.weight if has_real_weight(drafter.embed_tokens) else None
        fill_unloaded(drafter.lm_head.weight, options.fill, source)
        provenance.sources[HEAD] = f"unfilled:{options.fill}"
    elif HEAD in own.tensors:
        load_module(drafter.lm_head, own, lambda _name: HEAD)
        provenance.sources[HEAD] = f"checkpoint:{HEAD}"
    elif has_real_weight(target.lm_head):
        drafter.lm_head = target.lm_head
        provenance.sources[HEAD] = "alias:lm_head"
    else:
        key = target_head_key(target_checkpoint)
        load_module(drafter.lm_head, target_checkpoint, lambda _name: key)
        provenance.sources[HEAD] = f"checkpoint:{key}"


class DrafterCheckpoint(Checkpoint):
    """A drafter that is a checkpoint of its own (DSpark, runtime/models/dspark.py): a config the runtime runs
    or refuses outright, and its own tensors."""

    what = "drafter"

    @staticmethod
    def read_config(raw, source: str):
        return read_dspark_config(raw, source)

    def unrunnable_reason(self) -> str | None:
        return self.quantization_refusal()


def drafter_checkpoint_path(model: str, speculative_model: str | None) -> str | None:
    """The drafter checkpoint to open: the one asked for, else the one a demo model brings (named, or by its
    directory), else None."""
    if speculative_model is not None:
        return speculative_model
    path = resolve_model_path(model)
    found = next(
        (DEMO_DRAFTERS[name] for name, demo in DEMO_MODELS.items() if demo == path and name in DEMO_DRAFTERS), None
    )
    return str(found) if found else None


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
