"""Which target layer each of a block drafter's taps really holds, measured through the live pipeline.

Every rank runs a probe prompt through its layers, fingerprints the residual-stream entry after each layer
it owns (a projection of every position's state on a fixed random direction) and sends those to the
drafter's rank, which fingerprints the taps it was handed the way the engine moves them. A tap that equals
its own layer's entry is right; one that equals another layer's is off by that many layers; all zeros never
arrived. The same tensors travel bit for bit, so the comparison is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdoctor.runtime.decode.pipeline import RankModel, pipeline_pass
from specdoctor.runtime.drafter.taps import entry_owner


@dataclass
class TapReading:
    layer_id: int  # the target layer the drafter expects (config's target_layer_ids): entry layer_id + 1
    owner: int  # the rank that owns that layer
    found: str  # "ok", "zeros", "entry N" (another layer's state: entry N), or "unknown"


def local_entries(model: RankModel) -> tuple[int, ...]:
    """Every entry this rank's stage can capture: after each of its layers, and the embedding on the first."""
    layers = model.placement.layers
    return (0,) * model.placement.is_first + tuple(range(layers.start + 1, layers.stop + 1))


def fingerprints(states: torch.Tensor) -> torch.Tensor:  # [1, T, H] -> [T] (float64)
    direction = torch.randn(states.shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return states[0].double().cpu() @ direction


@torch.no_grad()
def probe_taps(model: RankModel, prompt: list[int]) -> list[TapReading] | None:
    """On every rank in lockstep; the drafter's rank returns one reading per tap, the others None."""
    config, stage = model.stage.config, model.stage
    ids = torch.tensor(prompt, device=model.device)[None]
    positions = torch.arange(len(prompt), device=model.device)[None]
    routed, captured = stage.tap_entries, {}
    stage.tap_entries = tuple(sorted(set(routed) | set(local_entries(model))))
    try:
        _, taps = pipeline_pass(model, ids, positions, model.cache(1, len(prompt)), captured)
    finally:
        stage.tap_entries = routed
    table = torch.full((config.num_hidden_layers + 1, len(prompt)), float("nan"), dtype=torch.float64)
    for entry, states in captured.items():
        table[entry] = fingerprints(states)
    gathered = model.comm.gather(table.to(model.device), model.placement.world_size - 1, "tap fingerprints")
    if gathered is None:
        return None
    reference = gathered.nan_to_num(0.0).sum(0).cpu()  # each entry is filled on exactly one rank
    expected = model.kind.taps
    readings = []
    for slot, entry in enumerate(expected):
        tap = taps[:, :, slot]
        printed = fingerprints(tap)
        matches = [e for e in range(len(reference)) if torch.equal(printed, reference[e])]
        if entry in matches:
            found = "ok"
        elif not tap.any():
            found = "zeros"
        else:
            found = f"entry {matches[0]}" if matches else "unknown"
        readings.append(TapReading(entry - 1, entry_owner(entry, model.taps.layers), found))
    return readings
