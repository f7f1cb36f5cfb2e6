"""The tap probe's own parts (runtime/tap_probe.py): which residual-stream entries each rank can capture,
the fingerprints it compares, and one reading on a whole pipeline of one rank built in this process. The
probe across real pipeline ranks, and the faults it names there, are tests/runtime/drafter/test_dspark_pipeline.py's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.comm import PipelineComm
from specdoctor.runtime.decode.pipeline import RankModel
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.partition import placements
from specdoctor.runtime.rank_loading import build_rank
from specdoctor.runtime.tap_probe import TapReading, fingerprints, local_entries, probe_taps


def rank_models(layers: int, pp: int, partition: str | None) -> list[RankModel]:
    """Each rank's RankModel as far as local_entries reads it: its placement (demo-dspark's target config,
    with its layer count overridden)."""
    config = dataclasses.replace(Checkpoint("demo-dspark").config, num_hidden_layers=layers)
    ranks = placements(config, pp, partition, has_drafter=True)
    return [RankModel(p, None, None, None, torch.device("cpu"), torch.float32) for p in ranks]


@pytest.mark.parametrize(
    "layers, pp, partition, expected",
    [
        (6, 1, None, [(0, 1, 2, 3, 4, 5, 6)]),
        (6, 3, None, [(0, 1, 2), (3, 4), (5, 6)]),  # layers [0, 2), [2, 4), [4, 6)
        (6, 3, "3,0,3", [(0, 1, 2, 3), (), (4, 5, 6)]),  # the middle rank owns no layer, so no entry
        (5, 2, "1,4", [(0, 1), (2, 3, 4, 5)]),
    ],
)
def test_local_entries_are_the_embedding_on_the_first_rank_and_each_owned_layers_output(
    layers, pp, partition, expected
):
    """Entry j is the state entering layer j (0: the embedding's output): a rank captures the entry after
    each layer it owns. Across the ranks every entry 0..layers is captured exactly once, which the probe's
    gather relies on (it sums the ranks' tables, each entry filled on one rank)."""
    entries = [local_entries(model) for model in rank_models(layers, pp, partition)]
    assert entries == expected
    flat = [entry for rank in entries for entry in rank]
    assert sorted(flat) == list(range(layers + 1)) and len(set(flat)) == len(flat)


def test_fingerprints_are_equal_for_equal_states_and_differ_otherwise():
    generator = torch.Generator().manual_seed(0)
    states = torch.randn(1, 9, 192, generator=generator)
    printed = fingerprints(states)
    assert printed.shape == (9,) and printed.dtype == torch.float64
    assert torch.equal(fingerprints(states.clone()), printed)  # deterministic: the same direction every call
    assert torch.equal(fingerprints(torch.cat([states, torch.randn(2, 9, 192)])), printed)  # batch row 0 only
    other_layer = states + 0.01 * torch.randn(1, 9, 192, generator=generator)
    assert (fingerprints(other_layer) != printed).all()  # every position tells them apart
    one_position = states.clone()
    one_position[0, 4, 17] += 1.0
    changed = fingerprints(one_position) != printed
    assert changed.tolist() == [t == 4 for t in range(9)]  # per position
    assert not fingerprints(torch.zeros(1, 9, 192)).any()  # a tap that never arrived prints zeros
    half = states.to(torch.bfloat16)  # the pipeline's dtype: the same values print the same in either dtype
    assert torch.equal(fingerprints(half), fingerprints(half.float()))


@pytest.fixture(scope="module")
def one_rank() -> RankModel:
    """demo-dspark (a 6-layer target whose DSpark drafter reads target layers 1, 3 and 5) as a one-rank
    pipeline, connected alone (no process group at PP 1)."""
    model, _ = build_rank(RuntimeOptions("demo-dspark", pp=1), 0)
    model.comm = PipelineComm(0, 1, 1, model.device, 60.0)
    return model


def test_an_in_process_reading_finds_every_tap_at_its_layer_and_restores_the_stages_taps(one_rank):
    model = one_rank
    routed = model.stage.tap_entries
    assert routed == model.kind.taps == (2, 4, 6)  # vLLM's + 1: the entries after layers 1, 3 and 5
    readings = probe_taps(model, list(range(3, 19)))
    assert readings == [TapReading(1, 0, "ok"), TapReading(3, 0, "ok"), TapReading(5, 0, "ok")]
    assert model.stage.tap_entries == routed  # the probe captures every entry only for its own pass
