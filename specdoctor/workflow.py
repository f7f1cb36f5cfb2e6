"""Diagnose and repair, once for every command: pre-flight (headers) → load → measure the drafter →
findings → repair → measure again → findings. `check` and `repair` run it with the correctness battery;
`serve` runs its start-up part on the engine it is about to serve from. Commands only parse flags and
render what this returns.

The runtime and the checks are imported inside the functions: the CLI itself starts without torch.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.errors import SpecdoctorError
from specdoctor.report import CheckReport, Finding, StageResult
from specdoctor.runtime.options import RuntimeOptions

TAP_PROBE_TOKENS = 16  # of the first battery prompt, through the pipeline once per stage


@dataclass(frozen=True)
class CheckOptions:
    runtime: RuntimeOptions
    repair: bool = False
    battery: Path | None = None
    min_acceptance_length: float = DEFAULT_MIN_ACCEPTANCE_LENGTH
    max_tokens: int = 32
    tp_rank: int = 0  # the TP rank whose vocab shard of the repair is checked (size: runtime.tp)

    def validate(self) -> None:
        if self.runtime.num_speculative_tokens < 1:
            raise SpecdoctorError(
                f"--num-speculative-tokens must be in 1..8, got {self.runtime.num_speculative_tokens}"
            )
        if not 0 <= self.tp_rank < self.runtime.tp:
            raise SpecdoctorError(f"--tp-rank {self.tp_rank} is outside 0..{self.runtime.tp - 1}")
        if self.max_tokens < 1:
            raise SpecdoctorError("--max-tokens must be at least 1")


@dataclass
class DrafterExam:
    """What the loaded-drafter stage found on a live engine."""

    findings: list[Finding]
    broken: list[str]  # drafter tensors a checkpoint read can refill
    record: dict  # the report's view: tensors, provenance, broken (and taps, for a drafter that reads them)


def examine_drafter(engine, stage: str, tap_prompt: list[int]) -> DrafterExam:
    """Measure the live drafter on its rank against the checkpoint; where it reads the target's taps, probe
    which layer each really holds (`tap_prompt` through the pipeline once)."""
    from specdoctor.checks.drafter import drafter_findings
    from specdoctor.checks.dspark import tap_findings

    state = engine.measure_drafter()
    findings, broken = drafter_findings(state, stage)
    record = {"tensors": state.tensors, "provenance": state.provenance, "broken": broken}
    if engine.drafter.taps:
        readings = engine.probe_taps(tap_prompt)
        findings += tap_findings(readings, stage)
        record["taps"] = [dataclasses.asdict(reading) for reading in readings]
    return DrafterExam(findings, broken, record)


def preflight_findings(checkpoint, ranks, drafter) -> list[Finding]:
    """The pre-flight, headers only; where an MTP layer ships its own copies, their sampled rows too."""
    from specdoctor.checks.own_copies import own_copy_findings
    from specdoctor.checks.preflight import preflight

    return preflight(checkpoint, ranks, drafter) + own_copy_findings(checkpoint)


def run_check(options: CheckOptions, show_progress: bool) -> CheckReport:
    """`check` (and `repair`): the pre-flight, then the runtime stages where the runtime can run the pair."""
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.kind import DEFAULT_SPECULATIVE_TOKENS
    from specdoctor.runtime.drafter.kinds import drafter_kind
    from specdoctor.runtime.drafter.repair import vocab_shard_range
    from specdoctor.runtime.partition import placements

    runtime = options.runtime
    checkpoint = Checkpoint(runtime.model)
    drafter = drafter_kind(checkpoint, runtime.model, runtime.speculative_model)
    if runtime.num_speculative_tokens is None:
        k = drafter.default_speculative_tokens() if drafter else DEFAULT_SPECULATIVE_TOKENS
        runtime = dataclasses.replace(runtime, num_speculative_tokens=k)
    options = dataclasses.replace(options, runtime=runtime)
    options.validate()
    vocab_shard_range(checkpoint.config.vocab_size, runtime.tp, options.tp_rank)  # a TP size vLLM refuses
    ranks = placements(checkpoint.config, runtime.pp, runtime.pp_partition, has_drafter=drafter is not None)
    settings = {**settings_dict(runtime), **settings_dict(options)}
    findings = preflight_findings(checkpoint, ranks, drafter)
    report = CheckReport(str(checkpoint.path), settings, [placement_row(r) for r in ranks], findings)
    if drafter is None:
        return report  # nothing to run: the pre-flight error says why
    unrunnable = checkpoint.unrunnable_reason() or drafter.unrunnable_reason()
    if unrunnable:
        report.preflight.append(runtime_skipped(unrunnable))
        return report
    run_stages(report, options, checkpoint, show_progress)
    return report


def run_stages(report: CheckReport, options: CheckOptions, checkpoint, show_progress: bool) -> None:
    """Start the ranks; the target-only battery; the before stage; with --repair, repair and the after stage."""
    from specdoctor.battery import battery_prompts
    from specdoctor.runtime.checkpoint.tokenizer import load_codec
    from specdoctor.runtime.engine import Engine

    prompts, fallback = battery_prompts(options.battery, checkpoint, load_codec(checkpoint, options.runtime.tokenizer))
    if fallback:
        report.preflight.append(Finding("behaviour.battery", "warning", fallback, stage="preflight"))
    clock = StageClock(report.timings)
    # The runtime computes at TP 1; a larger --tensor-parallel-size names the vocab shard the repair checks.
    runtime = dataclasses.replace(options.runtime, tp=1)
    with Progress(console=Console(stderr=True), disable=not show_progress, transient=True) as progress:
        task = progress.add_task(f"starting {runtime.pp} pipeline rank(s)", total=4 + 3 * options.repair)
        stage = StageRunner(Engine(runtime, checkpoint), options, prompts, [], progress, task)
        try:
            clock.lap("start_ranks")
            progress.update(task, advance=1, description=f"battery: target only ({len(prompts)} prompts)")
            stage.plain = stage.engine.generate(prompts, options.max_tokens, num_speculative_tokens=0).tokens
            clock.lap("target_only_battery")
            progress.advance(task)
            report.stages.append(stage.run("before", str(runtime.drafter_policy)))
            clock.lap("before")
            if options.repair:
                repair_and_recheck(report, stage, lambda: Engine(runtime, checkpoint), clock)
        finally:
            stage.engine.close()
        clock.lap("stop_ranks")


def repair_and_recheck(report: CheckReport, stage: StageRunner, restart, clock: StageClock) -> None:
    """Repair what the before stage found broken and run the stage again. A drafter that crashed the
    pipeline is loaded again, as broken as before, in fresh ranks first."""
    options = stage.options
    if not stage.engine.alive:
        stage.engine.close()
        stage.engine = restart()
        clock.lap("restart_ranks")
    stage.progress.update(stage.task, description="repair: reading the drafter's tensors from the checkpoint")
    report.repair = stage.engine.repair_drafter(report.stages[0].drafter["broken"], options.runtime.tp, options.tp_rank)
    report.repair_findings = repair_findings(report.repair)
    clock.lap("repair")
    stage.progress.advance(stage.task)
    if report.repair.repaired:
        report.stages.append(stage.run("after", "repaired"))
        clock.lap("after")


@dataclass
class StageRunner:
    """Runs the loaded-drafter checks and the speculative battery on a live engine."""

    engine: object
    options: CheckOptions
    prompts: list[list[int]]
    plain: list[list[int]]  # target-only output, the lossless reference
    progress: Progress
    task: int

    def run(self, name: str, policy: str) -> StageResult:
        from specdoctor.checks.behaviour import crashed_battery, run_battery
        from specdoctor.runtime.comm import PipelineError

        self.progress.update(self.task, description=f"{name}: inspecting the loaded drafter")
        exam = examine_drafter(self.engine, name, self.prompts[0][:TAP_PROBE_TOKENS])
        self.progress.update(self.task, advance=1, description=f"{name}: battery with speculative decoding")
        options, k = self.options, self.options.runtime.num_speculative_tokens
        try:
            behaviour = run_battery(
                self.engine, self.prompts, self.plain, options.max_tokens, k, options.min_acceptance_length, name
            )
        except PipelineError as crash:  # a drafter tensor that is not one (an aliased placeholder) ends the engine
            behaviour = crashed_battery(str(crash), name)
        self.progress.advance(self.task)
        return StageResult(name, policy, exam.findings + behaviour.pop("findings"), exam.record, behaviour)


def startup_check(engine, repair: bool, tap_prompt: list[int], console: Console) -> list[Finding]:
    """`serve`'s start-up: the pre-flight and the loaded-drafter stage on the engine it serves from; with
    `repair`, what a checkpoint read fixes is repaired and measured again. Returns the error findings left."""
    from specdoctor.checks.preflight import preflight

    errors = [f for f in preflight(engine.checkpoint, engine.placements, engine.drafter) if f.severity == "error"]
    if engine.options.num_speculative_tokens == 0 or not engine.speculates:
        return errors
    exam = examine_drafter(engine, "startup", tap_prompt)
    if exam.broken and repair:
        result = engine.repair_drafter(exam.broken)
        console.print(f"repaired {', '.join(result.repaired)} from the checkpoint ({result.bytes_read:,} bytes)")
        exam = examine_drafter(engine, "startup", tap_prompt)
    return errors + [f for f in exam.findings if f.severity == "error"]


def runtime_skipped(reason: str) -> Finding:
    return Finding(
        "runtime.skipped",
        "warning",
        f"the loaded-drafter and behaviour stages did not run: {reason}",
        "the verdict rests on the pre-flight (headers only)",
        "preflight",
    )


def settings_dict(options) -> dict:
    """A dataclass's own fields as JSON values (paths and choices as strings; nested options left out)."""
    values = {spec.name: getattr(options, spec.name) for spec in dataclasses.fields(options)}
    return {
        name: (str(value) if isinstance(value, Path | str) else value)
        for name, value in values.items()
        if not isinstance(value, RuntimeOptions)
    }


def placement_row(placement) -> dict:
    return {
        "rank": placement.rank,
        "layers": [placement.layers.start, placement.layers.stop],
        "has_embedding": placement.has_embedding,
        "has_head": placement.has_head,
        "has_drafter": placement.has_drafter,
    }


class StageClock:
    """Seconds spent in each stage of a check, recorded into the report."""

    def __init__(self, timings: dict[str, float]):
        self.timings, self.last = timings, time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = round(now - self.last, 3)
        self.last = now


def repair_findings(repair) -> list[Finding]:
    findings = [
        Finding("repair", "info", f"filled {name} from {key}", stage="repair") for name, key in repair.repaired.items()
    ]
    shard = repair.tp_shard
    if shard:
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
