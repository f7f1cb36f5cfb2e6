"""The loaded-drafter examination on a live engine (measure, findings, the tap probe), the findings of its repair,
and the pre-flight. A check's examinations (preflight, before, after; startup for `serve`) and its repair name the
findings (their `stage` field, as the report writes it); "stage" in the code is a pipeline stage."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from specdoctor.report import CheckReport, Finding, StageResult

TAP_PROBE_TOKENS = 16  # of the first battery prompt, through the pipeline once per examination
# Drafter tensors a checkpoint read can refill, by TP rank (each TP rank repairs its own shard).
BrokenTensors = dict[int, list[str]]


@dataclass
class DrafterExam:
    """What the loaded-drafter examination found."""

    findings: list[Finding]
    broken: BrokenTensors
    record: dict  # the report's view: tensors, provenance, broken (and taps, for a drafter that reads them)


def examine_drafter(engine, examination: str, tap_prompt: list[int]) -> DrafterExam:
    """Measure the live drafter on its rank against the checkpoint; where it reads the target's taps, probe
    which layer each really holds (`tap_prompt` through the pipeline once)."""
    from specdoctor.checks.taps import tap_findings

    exam = exam_of(engine.measure_drafter(), examination)
    if engine.drafter.taps:
        readings = engine.probe_taps(tap_prompt)
        exam.findings += tap_findings(readings, examination)
        exam.record["taps"] = [dataclasses.asdict(reading) for reading in readings]
    return exam


def exam_of(state, examination: str) -> DrafterExam:
    """The findings about a measured drafter (runtime/drafter/measure.py), what a repair can refill, and the
    report's record of it."""
    from specdoctor.checks.drafter import drafter_findings

    findings, broken = drafter_findings(state, examination)
    record = {**state.report(), "broken": sorted(set().union(*broken.values()))}
    if state.tp_ranks:  # which TP rank's shard is broken
        record["broken_by_tp_rank"] = {rank: names for rank, names in broken.items() if names}
    return DrafterExam(findings, broken, record)


def preflight_findings(checkpoint, ranks, drafter) -> list[Finding]:
    """The pre-flight, headers only; where the drafter's kind reads sampled rows (an MTP layer's own copies),
    those too."""
    from specdoctor.checks.preflight import preflight, sampled_preflight

    return preflight(checkpoint, ranks, drafter) + sampled_preflight(drafter)


def skipped(what: str, reason: str, examination: str = "preflight") -> Finding:
    """A part of the check that did not run is an error: what was not verified is never reported healthy (exit 1)."""
    return Finding(
        "runtime.skipped",
        "error",
        f"{what} did not run: {reason}",
        "not verified: the verdict rests on the stages that ran",
        examination,
        {"stages": what, "reason": reason},
    )


def repair_findings(repair) -> list[Finding]:
    findings = [
        Finding("repair", "info", f"filled {name} from {key}", stage="repair") for name, key in repair.repaired.items()
    ]
    for shard in (result.tp_shard for result in repair.tp_ranks if result.tp_shard):
        verdict = "matches the table, padding zero" if shard.ok else "WRONG rows or padding"
        findings.append(
            Finding(
                "repair.tp_shard",
                "info" if shard.ok else "error",
                f"TP rank {shard.tp_rank}/{shard.tp_size}: rows {shard.rows} ({shard.real_rows} real, "
                f"{shard.padded_rows} padded), {verdict}",
                stage="repair",
            )
        )
    return findings


class CheckClock:
    """Seconds spent in each part of a check (starting the ranks included), recorded into the report."""

    def __init__(self, timings: dict[str, float]):
        self.timings, self.last = timings, time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.timings[part] = round(now - self.last, 3)
        self.last = now


def record_examination(report: CheckReport, clock: CheckClock, result: StageResult) -> None:
    """The examination's result in the report, and its time on the clock."""
    report.stages.append(result)
    clock.lap(result.name)


def record_repair(report: CheckReport, clock: CheckClock, repair):
    """Returns `repair`, the RepairResult, with its findings in the report."""
    report.repair, report.repair_findings = repair, repair_findings(repair)
    clock.lap("repair")
    return repair
