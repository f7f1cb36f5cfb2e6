"""A drafter that is a checkpoint of its own: a DSpark block drafter, an EAGLE-3 head or a separate draft model
of a runtime family, told apart by its config.json (runtime/models/dspark.py, eagle3.py, draft_model.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from specdoctor.errors import CheckpointError
from specdoctor.runtime.checkpoint.keys import target_embedding_key, target_head_key
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.drafter.kind import EMBEDDING, HEAD, DrafterKind
from specdoctor.runtime.drafter.policy import Source
from specdoctor.runtime.options import HeadPolicy, RuntimeOptions


class DrafterCheckpoint(Checkpoint):
    """A drafter checkpoint: a config the runtime runs or refuses outright, and its own tensors. Its kind is
    the first of `kinds` (the registry's) that claims its config.json."""

    what = "drafter"

    def __init__(self, path, kinds: tuple[type[OwnCheckpointKind], ...], method: str | None = None):
        self.kinds, self.method = kinds, method  # vLLM's "method" where the user named one: a kind reads by it
        self.kind: type[OwnCheckpointKind] | None = None
        super().__init__(path)

    def read_config(self, raw, source: str):
        if isinstance(raw, dict):
            named = next((kind for kind in self.kinds if kind.read_by_method and kind.name == self.method), None)
            self.kind = named or next((kind for kind in self.kinds if kind.claims(raw)), None)
        if self.kind is not None:
            return self.kind.read_config(raw, source)
        found = (raw.get("architectures") or ["none"])[0] if isinstance(raw, dict) else "none"
        *first, last = (kind.recognised() for kind in self.kinds)
        raise CheckpointError(
            f"{source}: not a drafter the runtime runs (architectures {found!r}; "
            f"expected {', '.join(first)}, or {last})"
        )

    def unrunnable_reason(self) -> str | None:
        if isinstance(self.config, ModelConfig):  # a draft model: as any model the runtime runs
            return super().unrunnable_reason()
        return self.quantization_refusal()


class OwnCheckpointKind(DrafterKind):
    """A kind whose tensors are a checkpoint of its own, run beside a target without MTP layers (a draft model
    beside any: vLLM leaves the target's MTP layers unused then)."""

    runs_beside_mtp_layers: ClassVar[bool] = False
    read_by_method: ClassVar[bool] = False  # its method named, any config is read as this kind's (vLLM's rule)

    @staticmethod
    def claims(raw: dict) -> bool:
        """Whether a drafter checkpoint's config.json is this kind's."""
        raise NotImplementedError

    @staticmethod
    def read_config(raw: dict, source: str):
        """The config of a checkpoint this kind claims, read as vLLM reads it."""
        raise NotImplementedError

    @staticmethod
    def recognised() -> str:
        """What a config this kind claims looks like, for the refusal of one no kind claims."""
        raise NotImplementedError

    def __init__(self, target: Checkpoint, drafter: DrafterCheckpoint):
        super().__init__(target)
        self.drafter = drafter

    @property
    def checkpoint(self) -> DrafterCheckpoint:
        return self.drafter

    def problems(self) -> list[str]:
        """Why this drafter cannot draft for this target, from the headers (each a reason vLLM fails or drafts
        wrong): what the pre-flight reports too."""
        raise NotImplementedError

    def data_problems(self) -> list[str]:
        """Why it cannot, from a tensor's values (read here, beyond the headers the pre-flight reads)."""
        return []

    def unrunnable_reason(self) -> str | None:
        problems = self.problems()
        pairing = f"the drafter cannot draft for this target: {problems[0]}" if problems else None
        return self.drafter.unrunnable_reason() or pairing

    def require_runnable(self) -> None:
        target, drafter = self.target, self.drafter
        if target.config.num_nextn_predict_layers and not self.runs_beside_mtp_layers:
            raise CheckpointError(
                f"{target.path}: the target has its own MTP layers; a drafter checkpoint ({drafter.path}) is not "
                "run beside them"
            )
        problems = self.problems() or self.data_problems()
        if problems:
            raise CheckpointError(f"{drafter.path}: cannot draft for {target.path}: {problems[0]}")
        drafter.require_runnable()

    @property
    def layers_config(self) -> ModelConfig:
        """Its layers' config, whose sizes tensor parallelism splits as vLLM does (runtime/refusals.py's
        drafter refusal): a head's draft layers (DSpark, EAGLE-3)."""
        return self.drafter.config.backbone

    @property
    def draft_vocab_size(self) -> int | None:
        """A vocabulary of its own size its head drafts over, split as the target's (EAGLE-3's), or None."""
        return None

    def own_source(self, name: str) -> Source | None:
        return (self.drafter, name) if name in self.drafter.tensors else None

    @staticmethod
    def head_policy(options: RuntimeOptions) -> HeadPolicy:
        """vLLM 0.32 shares the target's lm_head with a drafter checkpoint that ships none at any PP size:
        engine-legacy loads the head as fixed does; the forced policies stay."""
        forced = (HeadPolicy.UNLOADED, HeadPolicy.TARGET)
        return options.head_policy if options.head_policy in forced else HeadPolicy.FIXED

    def checkpoint_key(self, name: str) -> str:
        """The drafter checkpoint's key of one of its module's tensors."""
        return name

    def over_target_positions(self, config: ModelConfig) -> ModelConfig:
        """Draft layers' config with its position range raised to the target's where shorter: the drafter
        runs at the target's positions, so its rotary table must cover them."""
        positions = max(config.max_position_embeddings, self.target.config.max_position_embeddings)
        return replace(config, max_position_embeddings=positions)

    def expected_source(self, name: str) -> Source:
        """The drafter's own tensor, else (embedding and head) the target's."""
        drafter, target, key = self.drafter, self.target, self.checkpoint_key(name)
        if key in drafter.tensors or name not in (EMBEDDING, HEAD):
            return drafter, key
        return target, target_embedding_key(target) if name == EMBEDDING else target_head_key(target)
