"""Adaptive speculation (runtime/decode/adaptive.py): steps switching between speculative and plain, in any order,
give plain greedy decoding's tokens and count only the speculative steps' drafts; a plain step keeps the drafter's
cache as a speculative step does; the serving loop measures both kinds; the policy takes the kind that yielded more."""

from __future__ import annotations

import random

import pytest
import torch

from specdoctor.runtime.decode.adaptive import MEASURED_STEPS, RETRY_EVERY, SpeculationPolicy, rows_range
from specdoctor.runtime.decode.batch import BatchState
from specdoctor.runtime.decode.continuous import RunningBatch
from specdoctor.runtime.decode.requests import SequenceRequest
from specdoctor.runtime.options import FEWEST_PLAIN_ROWS, RuntimeOptions
from specdoctor.runtime.protocol import Command, Join, Order
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.runtime.sampling import SamplingParams

K = 3
PROMPTS = [[5, 9, 14, 3, 8], [40, 41], [7, 7, 7, 7, 7, 7, 7], [100, 3, 250, 19]]
LIMITS = [30, 17, 24, 19]  # rows finish at different steps: the batch shrinks under both kinds of step


@pytest.fixture(scope="module", params=["demo", "demo-hybrid", "demo-mla", "demo-dspark", "demo-eagle3"])
def model(request):
    """GLM-4.5's grouped-query attention and Qwen3-Next's gated attention fill their cache entries alone; an MLA
    MTP layer, a DSpark drafter and an EAGLE-3 head run their first pass instead."""
    return load_rank(RuntimeOptions(request.param, num_speculative_tokens=K), 0)[0]


def decode(model, k: int, propose_next, sequences: list[SequenceRequest] | None = None) -> tuple[BatchState, int]:
    """`sequences` (PROMPTS to LIMITS) to their ends, step s proposing drafts for the next as `propose_next(s)`
    says; with the drafts the speculative steps proposed (k a row still running)."""
    sequences = sequences or [SequenceRequest(p, n) for p, n in zip(PROMPTS, LIMITS, strict=True)]
    state = BatchState(model, sequences, k)
    state.prefill()
    step = drafted = 0
    with torch.no_grad():
        while any(state.active):
            running = sum(state.active)
            state.step(propose_next(step))
            drafted += k * running if state.stepped_speculatively else 0
            state.commit(count_metrics=True)
            state.advance()
            step += 1
    return state, drafted


def test_steps_switching_between_speculative_and_plain_give_plain_greedy_tokens(model):
    plain, _ = decode(model, 0, lambda step: True)
    schedule = random.Random(0)
    choices = [schedule.random() < 0.5 for _ in range(max(LIMITS))]
    switched, drafted = decode(model, K, lambda step: choices[step])
    assert switched.result.tokens == plain.result.tokens
    assert [len(tokens) for tokens in switched.result.tokens] == LIMITS
    assert 0 < switched.result.metrics.num_draft_tokens == drafted  # plain steps record no drafts


def test_a_plain_step_keeps_the_drafters_cache_as_a_speculative_step_does(model):
    """Every position a row has filled holds, in the drafter's cache, the entries an always-speculating run's holds
    (the same tokens, the target's states rounded by passes of other shapes); without the plain steps' fill, the
    positions they decoded hold nothing."""
    always, _ = decode(model, K, lambda step: True)
    plain_runs = decode(model, K, lambda step: step % 5 in (0, 4))[0]  # two to three plain steps in a row
    assert plain_runs.result.tokens == always.result.tokens
    # a finished row stops advancing: the runs' last steps may leave it at different positions
    for row, filled in enumerate(torch.minimum(plain_runs.filled, always.filled).tolist()):
        # steps 0 and 1 fill at most 2(k + 1) positions: plain steps 2 to 4 decode within the prompt + 11
        assert filled >= len(PROMPTS[row]) + 11
        for layer, entries in plain_runs.drafts.cache.entries.items():
            for entry, expected in zip(entries, always.drafts.cache.entries[layer], strict=True):
                torch.testing.assert_close(entry[row, :filled], expected[row, :filled], atol=1e-4, rtol=1e-4)


EIGHT = [SequenceRequest(PROMPTS[n % 4] + [n], 40) for n in range(FEWEST_PLAIN_ROWS)]  # greedy, 40 tokens each


def eight_rows(model) -> RunningBatch:
    """The serving loop with EIGHT running (FEWEST_PLAIN_ROWS rows)."""
    running = RunningBatch(model, K, sampled_drafts=False, adaptive=True)
    running.apply([Order(Command.JOIN, Join(str(n), sequence)) for n, sequence in enumerate(EIGHT)])
    return running


def test_the_serving_loop_measures_both_kinds_of_step_and_stays_lossless(model):
    """Eight rows: the policy measures MEASURED_STEPS speculative steps, then as many plain ones, before a row
    finishes (steps that switch kinds are not measured)."""
    running = eight_rows(model)
    tokens = {request_id: list(update.new_tokens) for request_id, update in running.updates().items()}
    while running.ids:
        running.step()
        for request_id, update in running.updates().items():
            tokens[request_id] += update.new_tokens
    plain, _ = decode(model, 0, lambda step: True, EIGHT)
    assert [tokens[str(n)] for n in range(FEWEST_PLAIN_ROWS)] == plain.result.tokens
    assert running.policy.measured[True, rows_range(FEWEST_PLAIN_ROWS)] >= MEASURED_STEPS
    assert running.policy.measured[False, rows_range(FEWEST_PLAIN_ROWS)] >= MEASURED_STEPS


def test_a_seeded_request_joining_plain_steps_samples_as_it_does_alone(model):
    """A seeded sampled request draws from its generator as it does alone: it joins rows decoding plainly (the
    policy measuring plain steps), and every step after speculates, the plain rows verifying stand-in drafts that
    the metrics leave out."""
    seeded = SequenceRequest(PROMPTS[2], 20, SamplingParams(temperature=1.0, seed=5))
    alone, _ = decode(model, K, lambda step: True, [seeded])
    running = eight_rows(model)
    running.updates()
    while running.policy.measured[False, rows_range(FEWEST_PLAIN_ROWS)] < 2:  # two plain steps measured, two to come
        running.step()
        running.updates()
    assert not running.batch.speculating
    drafts_before = running.batch.result.row_metrics[0].num_drafts
    running.apply([Order(Command.JOIN, Join("seeded", seeded))])
    tokens = list(running.updates()["seeded"].new_tokens)
    assert running.batch.speculating and running.batch.stand_in_drafts == [True] * FEWEST_PLAIN_ROWS + [False]
    running.step()
    assert running.batch.result.row_metrics[0].num_drafts == drafts_before  # the stand-in drafts are not counted
    tokens += running.updates()["seeded"].new_tokens
    while "seeded" in running.ids:
        running.step()
        tokens += running.updates().get("seeded").new_tokens
    assert tokens == alone.result.tokens[0]


def test_the_policy_tries_each_kind_then_takes_the_faster_and_retries_the_slower():
    policy = SpeculationPolicy()
    kinds = []
    for _ in range(2 * MEASURED_STEPS):  # speculative steps yield 300 tokens/s at 8 rows, plain ones 400
        kinds.append(policy.speculate(8))
        policy.observe(kinds[-1], 8, 3 if kinds[-1] else 4, 0.01)
    assert kinds == [True] * MEASURED_STEPS + [False] * MEASURED_STEPS
    chosen = [policy.speculate(9) for _ in range(RETRY_EVERY - 1)]  # 9 rows: the same range as 8
    assert chosen == [False] * (RETRY_EVERY - 1)
    assert policy.speculate(8) is True  # the slower kind, measured again
    policy.observe(True, 8, 300, 0.01)  # a step far off its kind's rate moves the median little
    assert policy.speculate(8) is False
    for _ in range(4):  # now it yields 3,000 tokens/s: five of its latest eight steps
        policy.observe(True, 8, 30, 0.01)
    assert policy.speculate(8) is True
    assert policy.speculate(16) is True  # another range: nothing measured there yet
    policy.observe(False, 1, 4, 0.001)
    assert all(policy.speculate(1) for _ in range(2 * RETRY_EVERY))  # under FEWEST_PLAIN_ROWS: always
