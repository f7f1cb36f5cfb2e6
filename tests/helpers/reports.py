"""What two check reports of one checkpoint must share whatever else differs between the runs (the weights'
representation, the machine's speed): every finding, stage, repair and verdict, without the times taken."""

from __future__ import annotations

FINDING_FIELDS = ("preflight", "stages", "repair", "comparison", "findings", "verdict")


def findings_of(report: dict) -> dict:
    """The report's findings, stages, repair and verdict, the repair's duration left out."""
    fields = {field: report[field] for field in FINDING_FIELDS}
    if isinstance(fields["repair"], dict):
        fields["repair"] = {key: value for key, value in fields["repair"].items() if key != "seconds"}
    return fields
