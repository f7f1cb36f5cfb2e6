"""The loading-policy ladder, written once for every drafter kind: how a drafter's embedding and heads get
their weights, correctly or the ways engines got it wrong (docs/engine-semantics.md §Drafter embedding and
head under PP; docs/dspark.md §Loading under PP). A kind says where its own copy is (if it ships one) and
where the target's tensor is; the ladder does the rest. Each policy names the engine releases it
reproduces; vLLM 0.32.0 itself loads correctly (read from its installed source).

Embedding policies (--drafter-policy):
  fixed             the drafter's own copy where it ships one; else alias the target's embedding where it is
                    materialised on this rank, else read it from the target checkpoint (first candidate key).
                    What vLLM 0.32 does for MTP (at PP > 1 its MTP loader reads `model.embed_tokens.weight` and
                    raises on unloaded weights), SGLang after PR #37471, and the vllm-backport fork after PR #50
                    (the seed's fix, validated on DSpark too; vLLM 0.32 instead refuses a DSpark drafter at
                    PP > 1: "needs the target input embedding, but it is unavailable on this PP stage").
  engine-legacy     share only when PP size is 1; at PP > 1 only the drafter's own copy is loaded (an MTP
                    loader keeps only keys under the spec layer prefix), else it is left as allocated. vLLM's
                    MTP-under-PP support as first pushed in PR #46994 (V2 model runner, July 2026, before its
                    follow-up commit), the vllm-backport fork before PR #50 (the seed deployment: GLM-5.3-Flash
                    AWQ, PP 4; "skips embedding sharing wholesale whenever pp world_size != 1"), and SGLang's
                    Qwen3.5 MTP before PR #37471 (torch.empty: zeros, stale bytes or NaN).
  alias-placeholder share without checking that the target's embedding is materialised: at PP > 1 the
                    drafter aliases a PPMissingLayer, whose lookup hands back the token ids, and the first draft
                    step fails as vLLM's MTP layer does on them. The hazard the seed PR's `_has_real_weight`
                    guard exists for; no vLLM release aliases (0.32 shares at PP 1 only).
  A kind whose engines load a shipped copy before any sharing (DSpark) loads it under every policy.
Head policies (--head-policy):
  fixed             the drafter's own head, else the target's `lm_head` (vLLM 0.32, after PR #34385 for MTP).
  engine-legacy     the own head only, else left as allocated: vLLM before PR #34385 (Feb 2026), where GLM-5,
                    whose checkpoint has no own MTP head, got NaN logits and 0 of 279 drafts accepted. A kind
                    or layout every engine loads `lm_head` for (Qwen's `mtp.*`, DSpark) maps it to fixed.
  unloaded          left as allocated even when the checkpoint ships it: the same symptom, forced.
  target            the target's lm_head even where the drafter ships its own: over an EAGLE-3 head's reduced
                    draft vocabulary, vllm-ascend#11374 (acceptance 25 % -> 1.7 %).
What "left as allocated" holds is the fill: empty, zeros, nan, or stale (another weight's bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import torch
from torch import nn

from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.checkpoint.loader import load_module, materialize
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.faults import Faults
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import EmbeddingPolicy, Fill, HeadPolicy, RuntimeOptions

Source = tuple[Checkpoint, str]  # a checkpoint and the key of one tensor in it


class Origin(Enum):
    CHECKPOINT = "checkpoint"  # read from a checkpoint: the detail is its key
    ALIAS = "alias"  # a materialised module of the target's: the detail names it
    PLACEHOLDER = "placeholder"  # a module of the target's this rank does not hold (no weight)
    UNFILLED = "unfilled"  # left as allocated: the detail is the fill


@dataclass(frozen=True)
class TensorSource:
    """Where one drafter tensor came from; shown as 'ORIGIN:DETAIL' (checkpoint:KEY, alias:MODULE, ...)."""

    origin: Origin
    detail: str

    def __str__(self) -> str:
        return f"{self.origin.value}:{self.detail}"


@dataclass
class Provenance:
    """Where each drafter tensor came from. Anything unfilled (or a placeholder) is what the checks report."""

    sources: dict[str, TensorSource] = field(default_factory=dict)

    def unfilled(self) -> list[str]:
        unfilled = (Origin.UNFILLED, Origin.PLACEHOLDER)
        return [name for name, source in self.sources.items() if source.origin in unfilled]

    def labels(self) -> dict[str, str]:
        """As the reports show it: 'ORIGIN:DETAIL' per tensor."""
        return {name: str(source) for name, source in self.sources.items()}

    def read(self, names, key_of) -> None:
        """`names` read from a checkpoint, each under the key `key_of(name)`."""
        self.sources.update({name: TensorSource(Origin.CHECKPOINT, key_of(name)) for name in names})

    def missing(self, names) -> None:
        """`names` a checkpoint lacks: left as allocated."""
        self.sources.update({name: TensorSource(Origin.UNFILLED, "missing-from-checkpoint") for name in names})


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


class Placer:
    """Puts one drafter module's weight in place (loaded, aliased or left as allocated) and records where it
    came from."""

    def __init__(self, drafter: nn.Module, stage: TargetStage, options: RuntimeOptions, provenance: Provenance, device):
        self.drafter, self.stage, self.options, self.provenance = drafter, stage, options, provenance
        self.device, self.faults = device, Faults.parse(options.fault)

    def load(self, module: str, source: Source) -> None:
        checkpoint, key = source
        tp = tensor_parallel.current()
        if module == "embed_tokens" and self.faults.vocab_shard_shifted and tp.rank == tp.size - 1 > 0:
            tp = replace(tp, rank=tp.rank - 1)  # the fault: the previous rank's range
        load_module(self.drafter.get_submodule(module), checkpoint, lambda _name: key, tp)
        self.provenance.sources[f"{module}.weight"] = TensorSource(Origin.CHECKPOINT, key)

    def alias(self, module: str, target_module: nn.Module, label: str) -> None:
        self.drafter.set_submodule(module, target_module)
        real = has_real_weight(target_module)
        self.provenance.sources[f"{module}.weight"] = TensorSource(Origin.ALIAS if real else Origin.PLACEHOLDER, label)

    def leave_unloaded(self, module: str, stale: nn.Module) -> None:
        """What an engine's allocation holds; a stale fill takes `stale`'s bytes where it is materialised."""
        fill, owner = self.options.fill, self.drafter.get_submodule(module)
        materialize(owner, self.device)  # a lazily allocated drafter (checkpoint/loader.py) has no storage yet
        fill_unloaded(owner.weight, fill, stale.weight if has_real_weight(stale) else None)
        self.provenance.sources[f"{module}.weight"] = TensorSource(Origin.UNFILLED, str(fill))

    def embedding(self, own: Source | None, target: Source | None, own_copy_first: bool) -> None:
        """The drafter's `embed_tokens`: its `own` copy where shipped, else the target's (`target` in its
        checkpoint, or the stage's module). `own_copy_first`: engines load a shipped copy before any sharing."""
        policy, target_module = self.options.drafter_policy, self.stage.model.embed_tokens
        if self.faults.per_rank_sharing and tensor_parallel.current().rank > 0:
            self.leave_unloaded("embed_tokens", self.stage.lm_head)  # the fault: only TP rank 0 shares
        elif own and own_copy_first:
            self.load("embed_tokens", own)
        elif policy == EmbeddingPolicy.ALIAS_PLACEHOLDER or (
            policy == EmbeddingPolicy.ENGINE_LEGACY and self.options.pp == 1
        ):
            self.alias("embed_tokens", target_module, "model.embed_tokens")
        elif own:  # fixed, or engine-legacy at PP > 1: the one key under the spec layer prefix
            self.load("embed_tokens", own)
        elif policy == EmbeddingPolicy.FIXED and has_real_weight(target_module):
            self.alias("embed_tokens", target_module, "model.embed_tokens")
        elif policy == EmbeddingPolicy.FIXED and target:
            self.load("embed_tokens", target)
        else:  # engine-legacy at PP > 1 with no own copy (or no candidate key at all)
            self.leave_unloaded("embed_tokens", self.stage.lm_head)

    def head(self, module: str, own: Source | None, target: Source, policy: HeadPolicy) -> None:
        """A drafter head `module`: its `own` tensor where shipped, else the target's `lm_head` (the stage's
        module, which the drafter's rank holds, or `target` in its checkpoint)."""
        if policy == HeadPolicy.TARGET and has_real_weight(self.stage.lm_head):
            self.alias(module, self.stage.lm_head, "lm_head")
        elif policy not in (HeadPolicy.UNLOADED, HeadPolicy.TARGET) and own:
            self.load(module, own)
        elif policy == HeadPolicy.FIXED and has_real_weight(self.stage.lm_head):
            self.alias(module, self.stage.lm_head, "lm_head")
        elif policy in (HeadPolicy.FIXED, HeadPolicy.TARGET):
            self.load(module, target)
        else:
            self.leave_unloaded(module, self.drafter.embed_tokens)
