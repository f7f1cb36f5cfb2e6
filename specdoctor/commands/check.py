"""`specdoctor check` (and `repair`): the flags, and the rendering of the report the workflow
(specdoctor/workflow/) makes: pre-flight, loaded drafter, battery; with --repair, the same after it."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.commands.options import (
    BatteryOption,
    Engine,
    EngineOption,
    EngineTimeoutOption,
    HtmlOption,
    JsonReportOption,
    JunitOption,
    MinLengthOption,
    parse_size,
    passed_to_engine,
    runtime_command,
)
from specdoctor.commands.output import emit_report
from specdoctor.errors import SpecdoctorError
from specdoctor.report import CheckReport, Finding, acceptance_row, findings_table, placement_table, render_verdict
from specdoctor.runtime.options import EmbeddingPolicy, HeadPolicy, RuntimeOptions
from specdoctor.workflow.check import CheckOptions, run_check

# What an unpatched engine does with this checkpoint at this PP size; the draft tokens are resolved once
# the drafter is known (a DSpark drafter's block size, an EAGLE-3 head's proposal length, else 3).
CHECK_DEFAULTS = dict(
    num_speculative_tokens=None, drafter_policy=EmbeddingPolicy.ENGINE_LEGACY, head_policy=HeadPolicy.ENGINE_LEGACY
)


RepairFlag = Annotated[bool, typer.Option("--repair", help="Repair the drafter from the checkpoint and re-check.")]
MaxTokensOption = Annotated[int, typer.Option(help="Tokens generated per battery prompt.")]
MemoryLimitOption = Annotated[
    str | None,
    typer.Option(
        help="Plan the ranks within SIZE of memory (e.g. 8GiB; default: what the machine has available). A model "
        "that does not fit gets the pre-flight and the loaded-drafter stage on the drafter's rank alone."
    ),
]


@runtime_command(**CHECK_DEFAULTS)
def check(
    ctx: typer.Context,
    runtime: RuntimeOptions,
    repair: RepairFlag = False,
    battery: BatteryOption = None,
    min_acceptance_length: MinLengthOption = DEFAULT_MIN_ACCEPTANCE_LENGTH,
    max_tokens: MaxTokensOption = 32,
    memory_limit: MemoryLimitOption = None,
    json_out: JsonReportOption = None,
    junit_xml: JunitOption = None,
    html: HtmlOption = None,
    engine: EngineOption = Engine.SPECDOCTOR,
    engine_timeout: EngineTimeoutOption = 1800.0,
) -> None:
    """Detect a broken drafter under pipeline parallelism; with --repair, fix it from the checkpoint and prove it.
    With --engine vllm, inside the vLLM installed here: each worker's drafter, repaired in place."""
    passed = passed_to_engine(ctx, engine)
    limit = parse_size(memory_limit, "--memory-limit") if memory_limit else None
    options = CheckOptions(runtime, repair, battery, min_acceptance_length, max_tokens, limit)
    show_progress = json_out != "-"
    if engine is Engine.VLLM:
        from specdoctor.workflow.vllm_args import refuse_runtime_only
        from specdoctor.workflow.vllm_check import VllmCheckOptions, run_vllm_check

        if memory_limit:
            raise SpecdoctorError("--memory-limit plans specdoctor's own ranks: vLLM plans its own memory")
        refuse_runtime_only(runtime, RuntimeOptions(model=runtime.model, **CHECK_DEFAULTS))
        report = run_vllm_check(VllmCheckOptions(options, passed, engine_timeout), show_progress)
    else:
        report = run_check(options, show_progress)
    emit_report(report, json_out, junit_xml, render_check, html)


@runtime_command(**CHECK_DEFAULTS)
def repair(
    runtime: RuntimeOptions, json_out: JsonReportOption = None, junit_xml: JunitOption = None, html: HtmlOption = None
) -> None:
    """Same as `specdoctor check --repair`."""
    report = run_check(CheckOptions(runtime, repair=True), show_progress=json_out != "-")
    emit_report(report, json_out, junit_xml, render_check, html)


def render_check(report: CheckReport, console: Console) -> None:
    console.print(placement_table(report.placement))
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
