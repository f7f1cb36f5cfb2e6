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

from specdoctor.runtime.options import Fill


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
