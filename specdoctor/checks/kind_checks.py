"""What a drafter kind's own checks module (checks/mtp.py, dspark.py, eagle3.py, draft_model.py) gives the
stages that ask for it through checks/registry.py. The runtime's kind (runtime/drafter/) sits below the checks
and cannot name its checks: each checks module names its kind instead."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdoctor.checks.quantization import quantization
from specdoctor.report import Finding
from specdoctor.runtime.drafter.kind import DrafterKind
from specdoctor.runtime.partition import Placement


def no_findings(*_args) -> list[Finding]:
    return []


def target_quantization(drafter: DrafterKind) -> list[Finding]:
    """The target's quantisation, where the kind keeps no layers of its own in the target's checkpoint."""
    return quantization(drafter.target)


@dataclass(frozen=True)
class KindChecks:
    kind: type[DrafterKind]
    # The pre-flight of the pair from the headers: (drafter, ranks) -> findings.
    preflight: Callable[[DrafterKind, list[Placement]], list[Finding]]
    # The target checkpoint's quantisation, with what the kind keeps in it: drafter -> findings.
    quantization: Callable[[DrafterKind], list[Finding]] = target_quantization
    # The pre-flight's findings that read sampled rows, beyond the headers: drafter -> findings.
    sampled: Callable[[DrafterKind], list[Finding]] = no_findings
    # The behaviour verdicts of this kind alone, named before the battery's own: (drafter, proposal profile,
    # the battery's longest sequence, k, stage) -> findings.
    behaviour: Callable[[DrafterKind, dict, int, int, str], list[Finding]] = no_findings
