"""A drafter checkpoint beside its target in the runtime, as the drafter kinds' tests run it (EAGLE-3 heads,
draft models): the runtime options, greedy output with speculation off and on over PIPELINE_PROMPTS, the
pre-flight's findings and `check --repair`."""

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


def preflight_by_check(target, drafter, pp: int) -> dict[str, list]:
    """The pre-flight's findings for the pair at PP `pp`, grouped by their check."""
    from specdoctor.checks.preflight import preflight
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import drafter_kind
    from specdoctor.runtime.partition import placements

    checkpoint = Checkpoint(target)
    kind = drafter_kind(checkpoint, str(target), str(drafter))
    grouped: dict[str, list] = {}
    for finding in preflight(checkpoint, placements(checkpoint.config, pp, None, has_drafter=True), kind):
        grouped.setdefault(finding.check, []).append(finding)
    return grouped


def repaired_check(target, drafter, max_tokens: int, **fields):
    """`check --repair` with the kind's default k and `max_tokens` battery answers."""
    from specdoctor.workflow.check import CheckOptions, run_check

    runtime = drafter_options(target, drafter, num_speculative_tokens=None, **fields)
    return run_check(CheckOptions(runtime, repair=True, max_tokens=max_tokens), show_progress=False)
