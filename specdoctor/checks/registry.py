"""Each drafter kind's own checks, by the runtime kind's class: declared once, by the kind's checks module
(a new kind adds its module here)."""

from __future__ import annotations

from specdoctor.checks import draft_model, dspark, eagle3, mtp
from specdoctor.checks.kind_checks import KindChecks
from specdoctor.runtime.drafter.kind import DrafterKind

KIND_CHECKS = {checks.kind: checks for checks in (mtp.CHECKS, dspark.CHECKS, eagle3.CHECKS, draft_model.CHECKS)}


def checks_of(drafter: DrafterKind) -> KindChecks:
    return KIND_CHECKS[type(drafter)]
