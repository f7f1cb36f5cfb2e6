"""Continuous batching in the runtime: requests that join a running batch between steps, at different
times, greedy and seeded-sampled together, each equal to the same request run alone. On the hybrid
demo, so the regrouped rows carry KV caches and linear-attention recurrent states (PP 2)."""

from __future__ import annotations

import pytest

from specdoctor.runtime.decode.requests import SequenceRequest
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21]]
SAMPLINGS = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=5), SamplingParams()]
LIMITS = [24, 9, 17, 1]


def run_joining(engine: Engine) -> dict[str, list[int]]:
    """Request 0 starts alone; 1 and 2 join after its first step, 3 (one token) after theirs."""
    sequences = {
        str(i): SequenceRequest(prompt, limit, sampling, engine.eos_token_ids)
        for i, (prompt, limit, sampling) in enumerate(zip(PROMPTS, LIMITS, SAMPLINGS, strict=True))
    }
    engine.start_continuous()
    engine.join("0", sequences["0"])
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    waves = [["1", "2"], ["3"]]
    while len(finished) < len(sequences):
        for request_id, update in engine.next_updates().items():
            tokens.setdefault(request_id, []).extend(update.new_tokens)
            if update.finish_reason:
                finished.add(request_id)
        if waves and tokens:
            for request_id in waves.pop(0):
                engine.join(request_id, sequences[request_id])
    return tokens


@pytest.mark.timeout(240)
@pytest.mark.parametrize("adaptive", [False, True])
def test_requests_joining_a_running_batch_equal_their_solo_runs(adaptive):
    """Also with adaptive speculation (serve's default), its steps switching between speculative and plain."""
    options = RuntimeOptions("demo-hybrid", pp=2, num_speculative_tokens=3, adaptive_speculation=adaptive)
    with Engine(options) as engine:
        solo = [
            engine.generate([prompt], limit, sampling).tokens[0]
            for prompt, limit, sampling in zip(PROMPTS, LIMITS, SAMPLINGS, strict=True)
        ]
        joined = run_joining(engine)
    assert [joined[str(i)] for i in range(len(PROMPTS))] == solo
    assert [len(tokens) for tokens in solo] == LIMITS  # every request ran to its own limit
