"""The draft-model kind: a separate, smaller model of a runtime family drafting for its target (vLLM's
`"method": "draft_model"`, docs/draft-model.md). Every tensor is the draft checkpoint's own: vLLM shares
neither embedding nor head with it, so the embedding policies do not touch it (its own copy loads under every
one); `--head-policy unloaded` leaves its head as allocated. What engines get wrong about it is its position
range (`--draft-range-policy dummy`), a wiring fault no checkpoint read repairs.
"""

from __future__ import annotations

from functools import cached_property

import torch

from specdoctor.runtime.checkpoint.keys import target_key_for
from specdoctor.runtime.checkpoint.loader import allocate, load_module, materialize
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import tokenizer_differences
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.drafter.checkpoint import OwnCheckpointKind
from specdoctor.runtime.drafter.kind import HEAD
from specdoctor.runtime.drafter.policy import Placer, Provenance, Source
from specdoctor.runtime.models.draft_model import DraftModel
from specdoctor.runtime.models.registry import FAMILIES
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import DraftRangePolicy, HeadPolicy, RuntimeOptions


class DraftModelKind(OwnCheckpointKind):
    """A whole causal LM beside its target, on the last rank, with its own KV cache."""

    name = "draft_model"
    label = "draft model"
    stats_parts = ("embed_tokens", "lm_head")
    reads_tokens = True
    runs_beside_mtp_layers = True
    read_config = staticmethod(Checkpoint.read_config)  # a whole model of a runtime family, read as a target is

    @staticmethod
    def claims(raw: dict) -> bool:
        return (raw.get("architectures") or ["none"])[0] in FAMILIES

    @staticmethod
    def recognised() -> str:
        return f"a draft model, {', '.join(FAMILIES)}"

    @property
    def layers_config(self) -> ModelConfig:
        return self.drafter.config  # a whole model of a runtime family

    @property
    def draft_max_len(self) -> int:
        """vLLM's max_model_len for the draft: its own position range, capped by the target's."""
        return min(self.drafter.config.max_position_embeddings, self.target.config.max_position_embeddings)

    def problems(self) -> list[str]:
        """Why this model cannot draft for this target: what vLLM refuses, then what the runtime does not run."""
        draft, target = self.drafter.config, self.target.config
        problems = []
        if draft.vocab_size != target.vocab_size:  # vLLM: "should have the same vocabulary size"
            problems.append(f"its vocabulary of {draft.vocab_size} is not the target's {target.vocab_size}")
        # Same ids, other tokens: every draft is wrong. Added (special) tokens that differ only warn (checks/).
        base, _ = self.tokenizer_differences
        if base:
            problems.append(base)
        if any(map(draft.is_linear_attention, range(draft.num_hidden_layers))):
            problems.append("its linear-attention layers keep a recurrent state the runtime does not roll back")
        return problems

    @cached_property
    def tokenizer_differences(self) -> tuple[str | None, str | None]:
        """(base vocabulary, with added tokens): read once, for the refusal and the pre-flight alike."""
        return tokenizer_differences(self.drafter.path, self.target.path)

    def config_summary(self) -> dict:
        config = self.drafter.config
        return {
            "architecture": config.architecture,
            "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings,
            "draft_max_len": self.draft_max_len,
        }

    def module(self) -> DraftModel:
        """Its rotary table covers the target's positions too: past its own range `fixed` drafts on, as an
        engine without vLLM's length gate does."""
        return DraftModel(self.over_target_positions(self.drafter.config))

    @cached_property
    def key_for(self):
        """name -> key: the target loader's rule, on the draft's checkpoint (its embedding's key found once)."""
        return target_key_for(self.drafter)

    def checkpoint_key(self, name: str) -> str:
        return self.key_for(name)

    def engine_name(self, path: str) -> str:
        """A draft model is a whole model: vLLM's names are the target loader's, `model.` included."""
        return path

    def expected_source(self, name: str) -> Source:
        """Always its own checkpoint's tensor: vLLM shares nothing of the target's with a draft model."""
        return self.drafter, self.checkpoint_key(name)

    def dummy_drafts_past(self, options: RuntimeOptions) -> int | None:
        return self.draft_max_len if options.draft_range_policy == DraftRangePolicy.DUMMY else None

    def build(self, stage: TargetStage, options: RuntimeOptions, device: torch.device) -> tuple[DraftModel, Provenance]:
        config, unloaded = self.over_target_positions(self.drafter.config), options.head_policy == HeadPolicy.UNLOADED
        lazy = self.drafter.map_weights
        model = allocate(lambda: DraftModel(config), options.dtype.torch(), device, lazy)
        provenance = Provenance()
        skip_head = {HEAD} if unloaded else set()
        body = load_module(model, self.drafter, lambda name: None if name in skip_head else self.checkpoint_key(name))
        provenance.read(body.filled, self.checkpoint_key)
        provenance.missing(body.missing)
        if unloaded:
            Placer(model, stage, options, provenance, device).leave_unloaded("lm_head", model.model.embed_tokens)
        materialize(model, device)
        return model.eval(), provenance
