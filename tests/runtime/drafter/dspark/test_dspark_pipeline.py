"""A DSpark drafter across real pipeline ranks: the taps travel to the drafter's rank for any partition, so
PP 2, 3 and 4 give one process's drafts, tokens and acceptance counts, greedy and seeded sampling alike;
the tap faults change only the drafts, and the tap probe names each."""

from __future__ import annotations

import pytest

from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.sampling import SamplingParams
from tests.helpers.dspark import make_drafter, make_target

PROMPTS = [[5, 9, 14, 3, 77, 41, 8, 19], [101, 7], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
K = 4
SAMPLED = SamplingParams(temperature=0.8, seed=11)
PROBE = list(range(1, 17))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dspark_pipeline")
    make_target(root / "target")
    make_drafter(root / "drafter")
    return str(root / "target"), str(root / "drafter")


def run(pair, pp: int, partition: str | None = None, tap_policy: str = "fixed") -> dict:
    target, drafter = pair
    options = RuntimeOptions(target, pp=pp, pp_partition=partition, speculative_model=drafter, tap_policy=tap_policy)
    with Engine(options) as engine:
        greedy = engine.generate(PROMPTS, 16, num_speculative_tokens=K)
        return {
            "plain": engine.generate(PROMPTS, 16, num_speculative_tokens=0).tokens,
            "tokens": greedy.tokens,
            "drafts": greedy.proposals,
            "counts": [m.to_dict() for m in greedy.row_metrics],
            "sampled": engine.generate(PROMPTS, 16, SAMPLED, num_speculative_tokens=K).tokens,
            "taps": [reading.found for reading in engine.probe_taps(PROBE)],
        }


@pytest.fixture(scope="module")
def one_process(pair):
    return run(pair, 1)


# "3,0,3": the middle rank owns no layer (and so no tap): the taps still pass through it.
@pytest.mark.parametrize("pp, partition", [(2, None), (3, "3,0,3"), (4, None)])
def test_pipeline_gives_one_process_drafts_tokens_and_counts(pair, one_process, pp, partition):
    result = run(pair, pp, partition)
    assert result == one_process
    assert result["tokens"] == result["plain"]  # lossless
    assert result["taps"] == ["ok"] * 3
    assert sum(c["num_drafts"] for c in result["counts"]) > 0


@pytest.mark.parametrize(
    "policy, taps",
    [
        ("local-only", ["zeros", "zeros", "ok"]),  # layers 1 and 3 live on ranks 0 and 1, the drafter on rank 2
        ("off-by-one", ["entry 1", "entry 3", "entry 5"]),  # each tap is its layer's input, not its output
    ],
)
def test_a_tap_fault_changes_only_the_drafts_and_the_probe_names_it(pair, one_process, policy, taps):
    result = run(pair, 3, tap_policy=policy)
    assert result["taps"] == taps
    assert result["drafts"] != one_process["drafts"]
    assert result["tokens"] == result["plain"] == one_process["plain"]
