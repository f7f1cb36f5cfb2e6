"""Where a block drafter's taps come from under pipeline parallelism (docs/dspark.md §Pipeline parallelism).

The drafter, on the last rank, reads residual-stream entries of target layers that other ranks own. As in
vLLM 0.32 (`supports_aux_hidden_states_over_pp`), each rank appends the entries it captures to the hidden
states it sends on, so they travel rank to rank, point to point, to the drafter's rank; `TapPolicy`
reproduces the ways an engine gets this wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdoctor.runtime.models.eagle3 import engine_default_entries
from specdoctor.runtime.options import TapPolicy
from specdoctor.runtime.partition import Placement


def entry_owner(entry: int, layers: list[range]) -> int:
    """The rank that captures entry j (the state entering target layer j): the rank whose last layer is
    j - 1; the embedding output (j = 0) is the first rank's."""
    if entry == 0:
        return 0
    return next(rank for rank, owned in enumerate(layers) if owned.start < entry <= owned.stop)


def policy_entries(
    tap_entries: tuple[int, ...], policy: TapPolicy, misread_shift: int, num_target_layers: int
) -> tuple[int, ...]:
    """The entries an engine following `policy` captures for a drafter that reads `tap_entries`.
    `misread_shift`: where the off-by-one engine lands for this kind's id convention."""
    if policy == TapPolicy.OFF_BY_ONE:
        return tuple(sorted({min(max(entry + misread_shift, 0), num_target_layers) for entry in tap_entries}))
    if policy == TapPolicy.ENGINE_DEFAULT:
        return engine_default_entries(num_target_layers)
    return tap_entries


@dataclass(frozen=True)
class TapRoute:
    """One rank's part in moving the taps: what it captures, what arrives with the hidden states from the
    previous rank, and whether it sends everything on."""

    entries: tuple[int, ...]  # what the drafter is fed, in its fc's order
    own: tuple[int, ...]  # captured by this rank
    received: int  # taps arriving with the hidden states
    relayed: bool  # sent on with the hidden states (False: each rank keeps its own)
    is_last: bool
    layers: tuple[range, ...]  # every rank's target layers

    @property
    def sent(self) -> int:
        return 0 if self.is_last or not self.relayed else self.received + len(self.own)

    def assemble(self, upstream: list[torch.Tensor], own: dict[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """On the drafter's rank: every entry in order [B, T, taps, H]; an entry that never arrived is zeros."""
        arrived = dict(zip(self.entries[: len(upstream)], upstream, strict=True)) | own
        return torch.stack([arrived.get(entry, torch.zeros_like(like)) for entry in self.entries], dim=2)


def tap_route(entries: tuple[int, ...], policy: TapPolicy, placement: Placement, layers: list[range]) -> TapRoute:
    """`entries`: what the engine captures (`policy_entries`), in the drafter's fc order."""
    owners = [entry_owner(entry, layers) for entry in entries]
    relayed = policy != TapPolicy.LOCAL_ONLY
    upstream = sum(owner < placement.rank for owner in owners) if relayed else 0
    own = tuple(entry for entry, owner in zip(entries, owners, strict=True) if owner == placement.rank)
    return TapRoute(entries, own, upstream, relayed, placement.is_last, tuple(layers))
