"""How the drafter's embedding and head get their weights: correctly, or the ways engines got it wrong
(docs/engine-semantics.md §Drafter embedding and head under PP). Each policy names the engine
releases it reproduces; vLLM 0.32.0 itself loads correctly (read from its installed source).

Embedding policies:
  fixed             alias the target's embedding only when it is materialised on this rank, else read
                    it from the target checkpoint (first candidate key). What vLLM 0.32 does (at PP > 1
                    its MTP loader reads `model.embed_tokens.weight` and raises on unloaded weights),
                    SGLang after PR #37471, and the vllm-backport fork after PR #50 (the seed's fix).
  engine-legacy     share only when PP size is 1; the MTP loader keeps only keys under the spec layer
                    prefix, so at PP > 1 the embedding is left as allocated unless the checkpoint ships
                    the MTP layer's own copy. vLLM's MTP-under-PP support as first pushed in PR #46994
                    (V2 model runner, July 2026, before its follow-up commit), the vllm-backport fork
                    before PR #50 (the seed deployment: GLM-5.3-Flash AWQ, PP 4), and SGLang's Qwen3.5
                    MTP before PR #37471 (torch.empty: zeros, stale bytes or NaN).
  alias-placeholder share without checking that the target's embedding is materialised: at PP > 1 the
                    drafter aliases a PPMissingLayer, whose lookup hands back the token ids, and the
                    first draft step fails as vLLM's MTP layer does on them. The hazard the seed PR's
                    `_has_real_weight` guard exists for; no vLLM release aliases (0.32 shares at PP 1 only).
Head policies (`shared_head.head`):
  fixed             the MTP layer's own key, else the target's `lm_head` (vLLM 0.32, after PR #34385).
  engine-legacy     the own key only, else left as allocated: vLLM before PR #34385 (Feb 2026), where
                    GLM-5, whose checkpoint has no own head, got NaN logits and 0 of 279 drafts accepted.
                    Layouts without an own head (Qwen's `mtp.*`) load `lm_head` in every engine: as fixed.
  unloaded          left as allocated even when the checkpoint ships it: the same symptom, forced.
What "left as allocated" holds is the fill: empty, zeros, nan, or stale (another weight's bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.drafter.keys import (
    DRAFTER_EMBEDDING,
    drafter_embedding_key,
    drafter_head_name,
    drafter_layer_key,
    is_drafter_head,
    own_embedding_keys,
    own_head_key,
    target_head_key,
)
from specdoctor.runtime.loader import allocate, load_module
from specdoctor.runtime.models.mtp import MtpDrafter
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import EmbeddingPolicy, Fill, HeadPolicy, RuntimeOptions


@dataclass
class Provenance:
    """Where each drafter tensor came from: 'checkpoint:KEY', 'alias:MODULE', 'placeholder:MODULE'
    or 'unfilled:FILL'. Anything unfilled is what the checks report."""

    sources: dict[str, str] = field(default_factory=dict)

    def unfilled(self) -> list[str]:
        return [name for name, source in self.sources.items() if source.startswith(("unfilled", "placeholder"))]


def has_real_weight(module: nn.Module | None) -> bool:
    """Materialised on this rank: a module with a real `.weight` (a PPMissingLayer has none)."""
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.device.type != "meta"


def fill_unloaded(parameter: torch.Tensor, fill: Fill, stale_source: torch.Tensor | None) -> None:
    """Give an unloaded parameter what an engine's allocation would hold."""
    with torch.no_grad():
        if fill == Fill.ZEROS:
            parameter.zero_()
        elif fill == Fill.NAN:
            parameter.fill_(float("nan"))
        elif fill == Fill.STALE and stale_source is not None and stale_source.numel() >= parameter.numel():
            # A caching allocator hands back a freed block at least as large: here, another weight's bytes.
            parameter.copy_(stale_source.flatten()[: parameter.numel()].view(parameter.shape))
        # Fill.EMPTY: leave the bytes torch.empty gave.


def build_drafter(
    checkpoint: Checkpoint, target: TargetStage, options: RuntimeOptions, device: torch.device
) -> tuple[MtpDrafter, Provenance]:
    """The drafter on the last rank, loaded the way `options` says; `target` is that rank's stage."""
    config = checkpoint.config
    drafter = allocate(lambda: MtpDrafter(config), options.dtype.torch(), device)
    provenance = Provenance()
    body = load_module(
        drafter, checkpoint, lambda name: None if is_drafter_head(name) else drafter_layer_key(config, name)
    )
    provenance.sources.update({name: f"checkpoint:{drafter_layer_key(config, name)}" for name in body.filled})
    provenance.sources.update({name: "unfilled:missing-from-checkpoint" for name in body.missing})
    _place_embedding(drafter, checkpoint, target, options, provenance)
    _place_heads(drafter, checkpoint, target, options, provenance)
    return drafter.eval(), provenance


def _place_embedding(drafter, checkpoint, target, options: RuntimeOptions, provenance: Provenance) -> None:
    policy, target_embedding = options.drafter_policy, target.model.embed_tokens
    legacy_sharing = policy == EmbeddingPolicy.ENGINE_LEGACY and options.pp == 1
    if policy == EmbeddingPolicy.ALIAS_PLACEHOLDER or legacy_sharing:
        drafter.embed_tokens = target_embedding
        real = has_real_weight(target_embedding)
        provenance.sources[DRAFTER_EMBEDDING] = "alias:model.embed_tokens" if real else "placeholder:model.embed_tokens"
        return
    own_copy = checkpoint.first_present(own_embedding_keys(checkpoint.config))
    if policy == EmbeddingPolicy.FIXED and own_copy is None and has_real_weight(target_embedding):
        drafter.embed_tokens = target_embedding  # no own copy: the target's, shared where it lives
        provenance.sources[DRAFTER_EMBEDDING] = "alias:model.embed_tokens"
        return
    # fixed: the own copy, else the target's from the checkpoint; engine-legacy at PP > 1: the own copy
    # only, the one embedding key under the spec layer prefix.
    key = drafter_embedding_key(checkpoint) if policy == EmbeddingPolicy.FIXED else own_copy
    if key is None:
        stale = target.lm_head.weight if has_real_weight(target.lm_head) else None
        fill_unloaded(drafter.embed_tokens.weight, options.fill, stale)
        provenance.sources[DRAFTER_EMBEDDING] = f"unfilled:{options.fill}"
        return
    load_module(drafter.embed_tokens, checkpoint, lambda _name: key)
    provenance.sources[DRAFTER_EMBEDDING] = f"checkpoint:{key}"


def _place_heads(drafter, checkpoint, target, options: RuntimeOptions, provenance: Provenance) -> None:
    policy = options.head_policy
    if policy == HeadPolicy.ENGINE_LEGACY and checkpoint.config.mtp_keys.own_head is None:
        policy = HeadPolicy.FIXED  # a layout without an own head (Qwen's mtp.*): every engine loads lm_head
    for layer_id, layer in drafter.layers.items():
        name, key = drafter_head_name(int(layer_id)), own_head_key(checkpoint.config, int(layer_id))
        head = layer.shared_head.head
        if policy != HeadPolicy.UNLOADED and key in checkpoint.tensors:
            load_module(head, checkpoint, lambda _name, key=key: key)
            provenance.sources[name] = f"checkpoint:{key}"
        elif policy == HeadPolicy.FIXED and has_real_weight(target.lm_head):
            layer.shared_head.head = target.lm_head
            provenance.sources[name] = "alias:lm_head"
        elif policy == HeadPolicy.FIXED:
            fallback = target_head_key(checkpoint)
            load_module(head, checkpoint, lambda _name, key=fallback: key)
            provenance.sources[name] = f"checkpoint:{fallback}"
        else:
            stale = drafter.embed_tokens.weight if has_real_weight(drafter.embed_tokens) else None
            fill_unloaded(head.weight, options.fill, stale)
            provenance.sources[name] = f"unfilled:{options.fill}"
