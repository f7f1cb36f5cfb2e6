"""`specdoctor probe`: a live deployment's speculative decoding, judged over HTTP."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.commands.options import BatteryOption, JsonReportOption, JunitOption, MinLengthOption
from specdoctor.commands.output import emit_report
from specdoctor.report import ProbeReport, acceptance_row, findings_table, render_verdict

UrlOption = Annotated[str, typer.Option("--url", help="Base URL of the deployment, e.g. http://127.0.0.1:8000")]
ApiKeyOption = Annotated[str | None, typer.Option(help="Bearer token for the server.")]
ServedModelOption = Annotated[str | None, typer.Option("--model", help="Served model to probe (default: the first).")]
MaxTokensOption = Annotated[int, typer.Option(help="Tokens per battery prompt.")]
RequestTimeoutOption = Annotated[float, typer.Option(help="Seconds per request.")]
TimeoutOption = Annotated[float, typer.Option(help="Seconds for the whole probe.")]


def probe(
    url: UrlOption,
    api_key: ApiKeyOption = None,
    model: ServedModelOption = None,
    battery: BatteryOption = None,
    min_acceptance_length: MinLengthOption = DEFAULT_MIN_ACCEPTANCE_LENGTH,
    max_tokens: MaxTokensOption = 32,
    request_timeout: RequestTimeoutOption = 60.0,
    timeout: TimeoutOption = 600.0,
    json_out: JsonReportOption = None,
    junit_xml: JunitOption = None,
) -> None:
    """Check a live deployment's speculative decoding over HTTP; exit 0 healthy, 1 findings, 2 unusable input."""
    from specdoctor.probe.client import ProbeOptions, run_probe

    options = ProbeOptions(url, api_key, model, battery, min_acceptance_length, max_tokens, request_timeout, timeout)
    emit_report(run_probe(options), json_out, junit_xml, render_probe)


def render_probe(report: ProbeReport, console: Console) -> None:
    console.print(findings_table(f"Probe · {report.url} · {report.served_model}", report.findings))
    if report.metrics:
        table = Table(title=f"Acceptance from {report.source} figures (mean acceptance length counts the bonus token)")
        for column in ("mean acceptance length", "acceptance rate", "per-position rates", "battery"):
            table.add_column(column)
        table.add_row(*acceptance_row(report.metrics), report.battery)
        console.print(table)
    render_verdict(report, console)
