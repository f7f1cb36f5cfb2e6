"""`specdoctor check` (and `repair`): pre-flight, loaded drafter, battery; then, with --repair, the
same after the repair."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.commands.options import BatteryOption, JsonReportOption, JunitOption, MinLengthOption, runtime_command
from specdoctor.commands.output import emit_report
from specdoctor.errors import SpecdoctorError
from specdoctor.report import CheckReport, Finding, StageResult, acceptance_row, findings_table, render_verdict
from specdoctor.runtime.options import EmbeddingPolicy, HeadPolicy, RuntimeOptions

# What an unpatched engine does with this checkpoint at this PP size; the draft tokens are resolved once
# the drafter is known (a DSpark drafter's block size, else 3).
CHECK_DEFAULTS = dict(
    num_speculative_tokens=None, drafter_policy=EmbeddingPolicy.ENGINE_LEGACY, head_policy=HeadPolicy.ENGINE_LEGACY
)


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


TAP_PROBE_TOKENS = 16  # of the first battery prompt, through the pipeline once per stage

RepairFlag = Annotated[bool, typer.Option("--repair", help="Repair the drafter from the checkpoint and re-check.")]
MaxTokensOption = Annotated[int, typer.Option(help="Tokens generated per battery prompt.")]
TpRankOption = Annotated[int, typer.Option(help="Tensor-parallel rank whose vocab shard the repair checks.")]


@runtime_command(**CHECK_DEFAULTS)
def check(
    runtime: RuntimeOptions,
    repair: RepairFlag = False,
    battery: BatteryOption = None,
    min_acceptance_length: MinLengthOption = DEFAULT_MIN_ACCEPTANCE_LENGTH,
    max_tokens: MaxTokensOption = 32,
    tp_rank: TpRankOption = 0,
    json_out: JsonReportOption = None,
    junit_xml: JunitOption = None,
) -> None:
    """Detect a broken drafter under pipeline parallelism; with --repair, fix it from the checkpoint and prove it."""
    options = CheckOptions(runtime, repair, battery, min_acceptance_length, max_tokens, tp_rank)
    emit_report(run_check(options, show_progress=json_out != "-"), json_out, junit_xml, render_check)


@runtime_command(**CHECK_DEFAULTS)
def repair(runtime: RuntimeOptions, json_out: JsonReportOption = None, junit_xml: JunitOption = None) -> None:
    """Same as `specdoctor check --repair`."""
    report = run_check(CheckOptions(runtime, repair=True), show_progress=json_out != "-")
    emit_report(report, json_out, junit_xml, render_check)


def run_check(options: CheckOptions, show_progress: bool) -> CheckReport:
    # Imported here: the CLI itself starts without torch (probe and --help need none).
    from specdoctor.checks.own_copies import own_copy_findings
    from specdoctor.checks.preflight import preflight
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.dspark import DrafterCheckpoint, default_speculative_tokens, drafter_checkpoint_path
    from specdoctor.runtime.drafter.repair import vocab_shard_range
    from specdoctor.runtime.partition import placements

    runtime = options.runtime
    checkpoint = Checkpoint(runtime.model)
    drafter_path = drafter_checkpoint_path(runtime.model, runtime.speculative_model)
    drafter = DrafterCheckpoint(drafter_path) if drafter_path else None
    if runtime.num_speculative_tokens is None:
        runtime = dataclasses.replace(runtime, num_speculative_tokens=default_speculative_tokens(drafter))
    options = dataclasses.replace(options, runtime=runtime)
    options.validate()
    vocab_shard_range(checkpoint.config.vocab_size, runtime.tp, options.tp_rank)  # a TP size vLLM refuses
    ranks = placements(checkpoint.config, runtime.pp, runtime.pp_partition, block_drafter=drafter is not None)
    settings = {**settings_dict(runtime), **settings_dict(options)}
    # Pre-flight reads headers only; an MTP layer's own copies are compared with the target's rows too.
    findings = preflight(checkpoint, ranks, drafter) + own_copy_findings(checkpoint)
    report = CheckReport(str(checkpoint.path), settings, [placement_row(r) for r in ranks], findings)
    if not (checkpoint.config.num_nextn_predict_layers or drafter):
        return report  # nothing to run: the pre-flight error says why
    unrunnable = checkpoint.unrunnable_reason() or (drafter and drafter.unrunnable_reason()) or pairing_error(report)
    if unrunnable:
        report.preflight.append(runtime_skipped(unrunnable))
        return report
    run_stages(report, options, checkpoint, show_progress)
    return report


def pairing_error(report: CheckReport) -> str | None:
    """A drafter that cannot draft for this target (the pre-flight's error): nothing to run."""
    return next((f.message for f in report.preflight if f.check == "dspark.pairing"), None)


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
        from specdoctor.checks.drafter import drafter_findings
        from specdoctor.checks.dspark import tap_findings
        from specdoctor.runtime.comm import PipelineError

        self.progress.update(self.task, description=f"{name}: inspecting the loaded drafter")
        state = self.engine.measure_drafter()
        findings, broken = drafter_findings(state, name)
        drafter = {"tensors": state.tensors, "provenance": state.provenance, "broken": broken}
        if self.engine.drafter_checkpoint is not None:  # a block drafter: which layer each tap really holds
            readings = self.engine.probe_taps(self.prompts[0][:TAP_PROBE_TOKENS])
            findings += tap_findings(readings, name)
            drafter["taps"] = [dataclasses.asdict(reading) for reading in readings]
        self.progress.update(self.task, advance=1, description=f"{name}: battery with speculative decoding")
        options, k = self.options, self.options.runtime.num_speculative_tokens
        try:
            behaviour = run_battery(
                self.engine, self.prompts, self.plain, options.max_tokens, k, options.min_acceptance_length, name
            )
        except PipelineError as crash:  # a drafter tensor that is not one (an aliased placeholder) ends the engine
            behaviour = crashed_battery(str(crash), name)
        self.progress.advance(self.task)
        return StageResult(name, policy, findings + behaviour.pop("findings"), drafter, behaviour)


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


def render_check(report: CheckReport, console: Console) -> None:
    placement = Table(title=f"Placement · PP {report.settings['pp']}")
    for column in ("rank", "layers", "embedding", "head", "drafter"):
        placement.add_column(column)
    for rank in report.placement:
        start, stop = rank["layers"]
        flags = ("yes" if rank[key] else "-" for key in ("has_embedding", "has_head", "has_drafter"))
        placement.add_row(str(rank["rank"]), f"[{start}, {stop})", *flags)
    console.print(placement)
    console.print(findings_table("Pre-flight (headers only)", report.preflight))
    for stage in report.stages:
        console.print(findings_table(f"Loaded drafter and battery · {stage.name} · {stage.policy}", stage.findings))
        signals = stage.signals()
        if signals["content"] or signals["behaviour"]:
            content, behaviour = (", ".join(signals[kind]) or "none" for kind in ("content", "behaviour"))
            console.print(f"independent signals · content: {content} · behaviour: {behaviour}", highlight=False)
        if stage.name == "before" and report.repair is not None:
            repaired = report.repair_findings or [Finding("repair", "info", "nothing needed repair", stage="repair")]
            title = f"Repair · {report.repair.bytes_read:,} bytes read in {report.repair.seconds:.3f} s"
            console.print(findings_table(title, repaired))
    comparison = Table(title="Before / after (mean acceptance length counts the bonus token)")
    for column in ("stage", "policy", "mean acceptance length", "acceptance rate", "per-position rates", "battery"):
        comparison.add_column(column)
    for stage in report.stages:
        comparison.add_row(
            stage.name, stage.policy, *acceptance_row(stage.behaviour["metrics"]), stage.behaviour["battery"]
        )
    console.print(comparison)
    render_verdict(report, console)
