"""A drafter checkpoint beside its target in the runtime, as the drafter kinds' tests run it (EAGLE-3 heads,
draft models): the runtime options, and greedy output with speculation off and on over PIPELINE_PROMPTS."""

from __future__ import annotations

from tests.helpers.families import PIPELINE_PROMPTS

NEW_TOKENS = 12


def drafter_options(target, drafter, **fields):
    from specdoctor.runtime.options import RuntimeOptions

    return RuntimeOptions(str(target), speculative_model=str(drafter), timeout=60, **fields)


def plain_tokens_of(target) -> list[list[int]]:
    from specdoctor.runtime.engine import Engine
    from specdoctor.runtime.options import RuntimeOptions

    with Engine(RuntimeOptions(str(target), timeout=60)) as engine:
        return engine.generate(PIPELINE_PROMPTS, NEW_TOKENS).tokens


def speculative_run(target, drafter, pp: int, k: int):
    """Greedy output with `k` drafts a step at PP `pp`; the result asserts every draft was counted."""
    from specdoctor.runtime.engine import Engine

    with Engine(drafter_options(target, drafter, pp=pp)) as engine:
        result = engine.generate(PIPELINE_PROMPTS, NEW_TOKENS, num_speculative_tokens=k)
    assert result.metrics.num_draft_tokens == k * result.metrics.num_drafts > 0
    return result
