"""Which way a CPU rank runs its MoE layers' experts past the gathered limit: measured when it loads."""

from __future__ import annotations

import time

import pytest
import torch

from specdoctor.runtime.models.moe import GROUPED_CANDIDATES, MoE, measure_grouped_from
from specdoctor.runtime.moe_paths import choose_moe_paths
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.rank_loading import load_rank


def moe_layers(model) -> list[MoE]:
    return [layer for module in (model.stage, model.drafter) for layer in module.modules() if isinstance(layer, MoE)]


def test_a_cpu_rank_measures_the_grouped_gemm_once_per_expert_shape_and_a_later_start_reads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, info = load_rank(RuntimeOptions("demo", pp=1), 0)
    layers = moe_layers(model)
    assert len(layers) == 4  # the demo's three MoE target layers and its MTP layer's
    [(shape, grouped_from)] = info["grouped_from"].items()  # one expert shape: measured once
    assert shape == "8x256x192 torch.float32"
    assert grouped_from is None or grouped_from in GROUPED_CANDIDATES
    assert {layer.grouped_from for layer in layers} == {grouped_from}
    # A later start takes the kept answer (its saved graphs check it) rather than timing again.
    monkeypatch.setattr("specdoctor.runtime.moe_paths.measure_grouped_from", lambda layer: pytest.fail("timed again"))
    assert load_rank(RuntimeOptions("demo", pp=1), 0)[1]["grouped_from"] == {shape: grouped_from}


def test_no_grouped_gemm_is_timed_on_cuda_or_for_packed_experts():
    model, _ = load_rank(RuntimeOptions("demo", pp=1), 0)
    layers = moe_layers(model)
    for layer in layers:
        layer.grouped_from = None
    assert choose_moe_paths(layers, torch.device("cuda")) == {}
    layers[0].packed = True
    assert "8x256x192 torch.float32" in choose_moe_paths(layers, torch.device("cpu"))
    assert layers[0].grouped_from is None  # skipped: a packed layer runs its own quantised GEMMs


def sleeping(milliseconds_at) -> callable:
    """A path that takes milliseconds_at(tokens) (sleep only ever overshoots, and the best of the rounds is kept)."""

    def path(flat, weights, expert_ids):
        time.sleep(milliseconds_at(flat.shape[0]) / 1000)

    return path


@pytest.mark.parametrize(
    "every_ms, grouped_ms, expected",
    [
        (lambda n: 0.2 * n, lambda n: 8 + 0.05 * n, 64),  # every expert 4x the work; grouped a fixed cost more
        (lambda n: 0.2 * n, lambda n: 0.1 * n if n == 16 else 8 + 0.05 * n, 64),  # a win at 16 alone is not kept
        (lambda n: 0.05 * n, lambda n: 2 + 0.05 * n, None),  # never faster: never taken
    ],
)
def test_the_grouped_gemm_runs_from_the_first_size_past_which_it_was_always_faster(
    monkeypatch, every_ms, grouped_ms, expected
):
    model, _ = load_rank(RuntimeOptions("demo", pp=1), 0)
    layer = moe_layers(model)[0]
    monkeypatch.setattr(layer, "every_expert", sleeping(every_ms))
    monkeypatch.setattr(layer, "grouped_experts", sleeping(grouped_ms))
    assert measure_grouped_from(layer) == expected
