"""Examine the loaded drafter, repair what a checkpoint read refills, examine it again: the one loop that `check`,
serve's start-up check and the drafter's rank alone (a model larger than the machine) run, each with its own way to
examine and to repair."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdoctor.workflow.drafter import BrokenTensors, DrafterExam

if TYPE_CHECKING:  # the runtime is imported where it runs: the CLI starts without torch
    from specdoctor.runtime.drafter.repair import RepairResult


@dataclass(frozen=True)
class RepairRound:
    before: DrafterExam
    repair: RepairResult | None = None  # None when not asked to repair
    after: DrafterExam | None = None  # None when nothing was repaired

    @property
    def last(self) -> DrafterExam:
        return self.after or self.before


def examine_and_repair(
    examine: Callable[[str], DrafterExam],
    repair: Callable[[BrokenTensors], RepairResult] | None,
    examinations: tuple[str, str] = ("before", "after"),
) -> RepairRound:
    """`examine(examination)` names its findings by `examinations`; `repair` (None: not asked to) refills what the first
    examination found broken. The drafter is examined again when the repair filled anything (else it is as it was)."""
    before = examine(examinations[0])
    if repair is None:
        return RepairRound(before)
    result = repair(before.broken)
    return RepairRound(before, result, examine(examinations[1]) if result.repaired else None)
