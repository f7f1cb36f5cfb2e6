"""One interface for every kind of drafter (docs/architecture.md §Drafter kinds).

A kind (mtp.py, dspark.py) declares, once: which checkpoint tensor each of its tensors must hold (the
expected source, which measuring, the checks and the repair all use), how an engine loads it under each
policy (through the shared ladder in policy.py), what it reads from the target (the final-normed hidden
state, or the taps of named layers), and the module that drafts. The engine, the ranks, the partition,
the checks and the commands ask the kind; none of them names one. registry.py picks the kind of a pair.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from torch import nn

from specdoctor.errors import CheckpointError, SpecdoctorError
from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.checkpoint.keys import TARGET_EMBEDDING_KEYS
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.policy import Provenance, Source
from specdoctor.runtime.drafter.taps import policy_entries
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import RuntimeOptions, TapPolicy

EMBEDDING = "embed_tokens.weight"  # every kind's token embedding parameter
HEAD = "lm_head.weight"  # a drafter checkpoint's head: with the embedding, the target's unless it ships its own
DEFAULT_SPECULATIVE_TOKENS = 3  # check's k where a kind names no default of its own


class DraftingModule(Protocol):
    """What the decode loop asks of a live drafter (runtime/decode/speculative.py), and --compile of it
    (runtime/compile.py). A module without an argmax chain of its own or a cache-only fill declares them absent:
    `greedy_chain = None`, `fills_cache_only = False`."""

    graph_methods: tuple[str, ...]  # what --compile routes through graphs: `run_layers`, and the two below
    # Its whole argmax chain in one call (`greedy_drafts` runs it), or None; the decode loop takes it where
    # --compile made it one graph.
    greedy_chain: Callable[..., torch.Tensor] | None
    fills_cache_only: bool  # `fill` stores a pass's cache entries without the rest of the pass

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> KVCache: ...

    def draft(
        self,
        next_tokens: torch.Tensor,  # [B, T] the token after each new position
        features: torch.Tensor,  # [B, T, H] final-normed target states, [B, T, taps, H] the taps, or [B, T] tokens
        positions: torch.Tensor,  # [B, T]
        base: torch.Tensor,  # [B] the last accepted position: the chain continues from there
        cache: KVCache,
        k: int,
    ) -> Generator[torch.Tensor, torch.Tensor, None]:
        """Yields each draft position's logits [B, V]; send() back the token picked there [B]."""
        ...

    def greedy_drafts(self, next_tokens, features, positions, base, cache: KVCache, k: int) -> torch.Tensor:
        """`draft`'s chain with every draft an argmax, [B, k], in one call (where `greedy_chain` is not None)."""
        ...

    def fill(self, next_tokens, features, positions, cache: KVCache) -> None:
        """The cache entries at these positions and nothing else (where `fills_cache_only`)."""
        ...


class DrafterKind(ABC):
    """One kind of drafter paired with one target checkpoint."""

    name: ClassVar[str]  # as `--speculative-config`'s "method" spells it
    aliases: ClassVar[tuple[str, ...]] = ()  # vLLM's other "method" names for this kind
    label: ClassVar[str]  # for people: "MTP layers", "DSpark drafter"
    # Parts whose full statistics are worth a pass in the content check (every tensor is fingerprinted).
    stats_parts: ClassVar[tuple[str, ...]]
    drafts_in_blocks: ClassVar[bool] = False  # the whole block in one pass: its block shape is worth reading
    misread_shift: ClassVar[int] = 0  # where `--tap-policy off-by-one` lands for this kind's id convention
    reads_tokens: ClassVar[bool] = False  # fed the tokens at the new positions instead of the target's states

    def __init__(self, target: Checkpoint):
        self.target = target

    @classmethod
    def methods(cls) -> tuple[str, ...]:
        """Every "method" vLLM reads as this kind, its own name first (registry.py reads them)."""
        return (cls.name, *cls.aliases)

    @property
    def checkpoint(self) -> Checkpoint | None:
        """A checkpoint of the drafter's own, or None where its tensors live in the target's."""
        return None

    @property
    def path(self) -> Path | None:
        return self.checkpoint.path if self.checkpoint else None

    @property
    def checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint its tensors are read from."""
        return [self.target, *([self.checkpoint] if self.checkpoint else [])]

    @property
    def taps(self) -> tuple[int, ...]:
        """Residual-stream entries of the target it reads (entry j enters layer j); () for the final-normed state."""
        return ()

    def engine_taps(self, policy: TapPolicy) -> tuple[int, ...]:
        """The entries an engine following `policy` captures for this drafter, in its fc order. An engine that
        captures fewer distinct states than the drafter reads fails at its first draft step: refused here."""
        entries = policy_entries(self.taps, policy, self.misread_shift, self.target.config.num_hidden_layers)
        if len(entries) != len(self.taps):
            raise SpecdoctorError(
                f"--tap-policy {policy}: the engine would capture {len(entries)} distinct states {list(entries)} of "
                f"this {self.target.config.num_hidden_layers}-layer target where the drafter reads {len(self.taps)}; "
                "it fails at its first draft step"
            )
        return entries

    def engine_name(self, path: str) -> str:
        """This kind's name for the tensor an engine's drafter module holds at `path` (vLLM nests an MTP layer's
        or a head's tensors under `model.`, where this kind names them from the drafter's own root)."""
        return path.removeprefix("model.")

    def embedding_candidates(self) -> list[str]:
        """The target checkpoint's keys that can supply the drafter's embedding, in the order a correct loader
        tries them (the first present is its source): the target's own embedding."""
        return list(TARGET_EMBEDDING_KEYS)

    def default_speculative_tokens(self) -> int:
        return DEFAULT_SPECULATIVE_TOKENS

    def dummy_drafts_past(self, options: RuntimeOptions) -> int | None:
        """The length past which an engine following `options` drafts dummy tokens for this drafter (None: never)."""
        return None

    def unrunnable_reason(self) -> str | None:
        """Why the runtime will not run this drafter beside this target, or None."""
        return None

    def require_runnable(self) -> None:
        reason = self.unrunnable_reason()
        if reason:
            raise CheckpointError(f"{self.path or self.target.path}: {reason}")

    def config_summary(self) -> dict:
        """What `inspect` shows of a drafter checkpoint's own config."""
        return {}

    @abstractmethod
    def module(self) -> nn.Module:
        """The drafter's module as its engine builds it, uninitialised, on the current device (the meta device
        for its tensor names and sizes)."""

    def tensor_names(self) -> list[str]:
        """Every parameter and buffer the drafter has, from its module built on the meta device (a live module
        may hold an aliased placeholder instead of a tensor)."""
        with torch.device("meta"):
            return list(self.module().state_dict())

    @abstractmethod
    def expected_source(self, name: str) -> Source | None:
        """The checkpoint tensor a correctly loaded drafter parameter equals, or None where no checkpoint holds it."""

    @abstractmethod
    def build(self, stage: TargetStage, options: RuntimeOptions, device: torch.device) -> tuple[nn.Module, Provenance]:
        """The drafter on its rank beside that rank's target `stage`, loaded the way `options` say."""
