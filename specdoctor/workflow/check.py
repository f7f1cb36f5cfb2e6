"""`check` and `repair`: pre-flight (headers) → load → examine the drafter with the correctness battery →
repair → examine again (examine_and_repair.py), on the ranks or, for a model larger than the machine, on the
drafter's rank alone (alone.py). Commands only parse flags and render what this returns.

The runtime and the checks are imported inside the functions: the CLI itself starts without torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.errors import SpecdoctorError
from specdoctor.report import CheckReport, Finding, StageResult
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.workflow.drafter import (
    TAP_PROBE_TOKENS,
    BrokenTensors,
    CheckClock,
    DrafterExam,
    examine_drafter,
    preflight_findings,
    record_examination,
    record_repair,
    skipped,
)
from specdoctor.workflow.examine_and_repair import examine_and_repair


@dataclass(frozen=True)
class CheckOptions:
    runtime: RuntimeOptions
    repair: bool = False
    battery: Path | None = None
    min_acceptance_length: float = DEFAULT_MIN_ACCEPTANCE_LENGTH
    max_tokens: int = 32
    memory_limit: int | None = None  # bytes the ranks may hold together; None: what the machine has

    def validate(self) -> None:
        if self.runtime.num_speculative_tokens < 1:
            raise SpecdoctorError(
                f"--num-speculative-tokens must be in 1..8, got {self.runtime.num_speculative_tokens}"
            )
        if self.max_tokens < 1:
            raise SpecdoctorError("--max-tokens must be at least 1")


def run_check(options: CheckOptions, show_progress: bool) -> CheckReport:
    """`check` (and `repair`): the pre-flight, then the examinations on the runtime where it can run the pair."""
    from specdoctor.battery import battery_prompts
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.checkpoint.tokenizer import load_codec
    from specdoctor.runtime.drafter.registry import drafter_kind, speculative_tokens
    from specdoctor.runtime.memory import plan_memory
    from specdoctor.runtime.partition import placements
    from specdoctor.runtime.refusals import sharding_refusal
    from specdoctor.workflow.alone import run_drafter_rank_alone

    runtime = options.runtime
    checkpoint = Checkpoint(runtime.model)
    drafter = drafter_kind(checkpoint, runtime.model, runtime.speculative_model, runtime.speculative_method)
    k = speculative_tokens(drafter, runtime.num_speculative_tokens)
    runtime = dataclasses.replace(runtime, num_speculative_tokens=k)
    options = dataclasses.replace(options, runtime=runtime)
    options.validate()
    # What the runtime will not shard, before any rank starts or the memory plan; too few GPUs is refused where
    # ranks start (Engine): the pre-flight, and the drafter's rank alone, need no more than one
    refused = sharding_refusal(checkpoint, drafter, runtime)
    if refused:
        raise SpecdoctorError(refused)
    ranks = placements(checkpoint.config, runtime.pp, runtime.pp_partition, has_drafter=drafter is not None)
    settings = {**settings_dict(runtime), **settings_dict(options)}
    findings = preflight_findings(checkpoint, ranks, drafter)
    report = CheckReport(str(checkpoint.path), settings, [placement_row(r, runtime.tp) for r in ranks], findings)
    if drafter is None:
        return report  # nothing to run: the pre-flight error says why
    unrunnable = checkpoint.unrunnable_reason() or drafter.unrunnable_reason()
    if unrunnable:
        report.preflight.append(skipped("the loaded-drafter and behaviour stages", unrunnable))
        return report
    prompts, fallback = battery_prompts(options.battery, checkpoint, load_codec(checkpoint, runtime.tokenizer))
    if fallback:
        report.preflight.append(Finding("behaviour.battery", "warning", fallback, stage="preflight"))
    length = battery_length(prompts, options)
    plan = plan_memory(checkpoint, ranks, drafter, runtime, len(prompts), length, options.memory_limit)
    report.memory = plan.to_dict()
    try:
        if plan.fits:
            run_on_engine(report, options, checkpoint, prompts, show_progress)
        else:
            run_drafter_rank_alone(report, options, checkpoint, drafter, plan)
    except SpecdoctorError as err:
        err.report = report  # the findings computed before the error are written with it
        raise
    return report


def battery_length(prompts: list[list[int]], options: CheckOptions) -> int:
    """The longest sequence a battery run holds: prompt, new tokens and a step's drafts."""
    return max(map(len, prompts)) + options.max_tokens + 2 * options.runtime.num_speculative_tokens


def run_on_engine(report: CheckReport, options: CheckOptions, checkpoint, prompts, show_progress: bool) -> None:
    """Start the ranks; the target-only battery; the before examination; with --repair, repair and the after one."""
    from specdoctor.runtime.engine import Engine

    clock = CheckClock(report.timings)
    runtime = options.runtime
    with Progress(console=Console(stderr=True), disable=not show_progress, transient=True) as progress:
        task = progress.add_task(f"starting {runtime.pp * runtime.tp} rank(s)", total=4 + 3 * options.repair)
        check = EngineCheck(Engine(runtime, checkpoint), options, prompts, [], progress, task, report, clock)
        try:
            clock.lap("start_ranks")
            progress.update(task, advance=1, description=f"battery: target only ({len(prompts)} prompts)")
            check.plain = check.engine.generate(prompts, options.max_tokens, num_speculative_tokens=0).tokens
            clock.lap("target_only_battery")
            progress.advance(task)
            examine_and_repair(check.examine, check.repair if options.repair else None)
        finally:
            check.engine.close()
        clock.lap("stop_ranks")


@dataclass
class EngineCheck:
    """The loaded-drafter examination and the speculative battery on a live engine, and the drafter's repair there;
    each recorded into the report."""

    engine: object
    options: CheckOptions
    prompts: list[list[int]]
    plain: list[list[int]]  # target-only output, the lossless reference
    progress: Progress
    task: int
    report: CheckReport
    clock: CheckClock

    def examine(self, examination: str) -> DrafterExam:
        from specdoctor.checks.behaviour import crashed_battery, run_battery
        from specdoctor.errors import PipelineError

        self.progress.update(self.task, description=f"{examination}: inspecting the loaded drafter")
        exam = examine_drafter(self.engine, examination, self.prompts[0][:TAP_PROBE_TOKENS])
        self.progress.update(self.task, advance=1, description=f"{examination}: battery with speculative decoding")
        options, k = self.options, self.options.runtime.num_speculative_tokens
        try:
            behaviour = run_battery(
                self.engine, self.prompts, self.plain, options.max_tokens, k, options.min_acceptance_length, examination
            )
        except PipelineError as crash:  # a drafter tensor that is not one (an aliased placeholder) ends the engine
            behaviour = crashed_battery(str(crash), examination)
        self.progress.advance(self.task)
        policy = str(options.runtime.drafter_policy) if examination == "before" else "repaired"
        findings = exam.findings + behaviour.pop("findings")
        record_examination(self.report, self.clock, StageResult(examination, policy, findings, exam.record, behaviour))
        return exam

    def repair(self, broken: BrokenTensors):
        """A drafter that crashed the pipeline is loaded again, as broken as before, in fresh ranks first."""
        from specdoctor.runtime.engine import Engine

        if not self.engine.alive:
            self.engine.close()
            self.engine = Engine(self.options.runtime, self.engine.checkpoint)
            self.clock.lap("restart_ranks")
        self.progress.update(self.task, description="repair: reading the drafter's tensors from the checkpoint")
        repaired = record_repair(self.report, self.clock, self.engine.repair_drafter(broken))
        self.progress.advance(self.task)
        return repaired


def settings_dict(options) -> dict:
    """A dataclass's own fields as JSON values (paths and choices as strings; nested options left out)."""
    values = {spec.name: getattr(options, spec.name) for spec in dataclasses.fields(options)}
    return {
        name: (str(value) if isinstance(value, Path | str) else value)
        for name, value in values.items()
        if not isinstance(value, RuntimeOptions)
    }


def placement_row(placement, tp: int = 1) -> dict:
    """A pipeline stage's row of the placement table; `ranks`: its global ranks (TP ranks inner)."""
    return {
        "rank": placement.rank,
        "ranks": [placement.rank * tp + tp_rank for tp_rank in range(tp)],
        "layers": [placement.layers.start, placement.layers.stop],
        "has_embedding": placement.has_embedding,
        "has_head": placement.has_head,
        "has_drafter": placement.has_drafter,
    }
