"""The loaded-drafter stage on a live engine (measure, findings, the tap probe), its repair, and `serve`'s
start-up check, which is that stage alone."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from rich.console import Console

from specdoctor.report import Finding

TAP_PROBE_TOKENS = 16  # of the first battery prompt, through the pipeline once per stage


@dataclass
class DrafterExam:
    """What the loaded-drafter stage found on a live engine."""

    findings: list[Finding]
    broken: dict[int, list[str]]  # by TP rank: drafter tensors a checkpoint read can refill
    record: dict  # the report's view: tensors, provenance, broken (and taps, for a drafter that reads them)


def examine_drafter(engine, stage: str, tap_prompt: list[int]) -> DrafterExam:
    """Measure the live drafter on its rank against the checkpoint; where it reads the target's taps, probe
    which layer each really holds (`tap_prompt` through the pipeline once)."""
    from specdoctor.checks.taps import tap_findings

    exam = exam_of(engine.measure_drafter(), stage)
    if engine.drafter.taps:
        readings = engine.probe_taps(tap_prompt)
        exam.findings += tap_findings(readings, stage)
        exam.record["taps"] = [dataclasses.asdict(reading) for reading in readings]
    return exam


def exam_of(state, stage: str) -> DrafterExam:
    """The findings about a measured drafter (runtime/drafter/measure.py), what a repair can refill, and the
    report's record of it."""
    from specdoctor.checks.drafter import drafter_findings

    findings, broken = drafter_findings(state, stage)
    record = {**state.report(), "broken": sorted(set().union(*broken.values()))}
    if state.tp_ranks:  # which TP rank's shard is broken
        record["broken_by_tp_rank"] = {rank: names for rank, names in broken.items() if names}
    return DrafterExam(findings, broken, record)


def preflight_findings(checkpoint, ranks, drafter) -> list[Finding]:
    """The pre-flight, headers only; where the drafter's kind reads sampled rows (an MTP layer's own copies),
    those too."""
    from specdoctor.checks.preflight import preflight, sampled_preflight

    return preflight(checkpoint, ranks, drafter) + sampled_preflight(drafter)


def startup_check(engine, repair: bool, tap_prompt: list[int], console: Console) -> list[Finding]:
    """`serve`'s start-up: the pre-flight and the loaded-drafter stage on the engine it serves from; with
    `repair`, what a checkpoint read fixes is repaired and measured again. Returns the error findings left."""
    from specdoctor.checks.preflight import preflight

    errors = [f for f in preflight(engine.checkpoint, engine.placements, engine.drafter) if f.severity == "error"]
    if engine.options.num_speculative_tokens == 0 or not engine.speculates:
        return errors
    exam = examine_drafter(engine, "startup", tap_prompt)
    if any(exam.broken.values()) and repair:
        result = engine.repair_drafter(exam.broken)
        console.print(f"repaired {', '.join(result.repaired)} from the checkpoint ({result.bytes_read:,} bytes)")
        exam = examine_drafter(engine, "startup", tap_prompt)
    return errors + [f for f in exam.findings if f.severity == "error"]


def stage_skipped(stages: str, reason: str, stage: str = "preflight") -> Finding:
    """A stage that did not run is an error: what was not verified is never reported healthy (exit 1)."""
    return Finding(
        "runtime.skipped",
        "error",
        f"{stages} did not run: {reason}",
        "not verified: the verdict rests on the stages that ran",
        stage,
        {"stages": stages, "reason": reason},
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


class StageClock:
    """Seconds spent in each stage of a check, recorded into the report."""

    def __init__(self, timings: dict[str, float]):
        self.timings, self.last = timings, time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = round(now - self.last, 3)
        self.last = now
