"""Where a command's results go: tables on stdout, or only JSON with `--json -`; optional report files."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import typer
from rich.console import Console

from specdoctor.errors import SpecdoctorError
from specdoctor.report import Report, to_json, to_junit


def write_text(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise SpecdoctorError(f"{path}: cannot write report ({err.strerror})") from None


def emit_json_or_table(text: str, json_out: str | None, render: Callable[[Console], None]) -> None:
    """JSON alone on stdout with `--json -`; else the human rendering, and the JSON to `--json FILE`."""
    if json_out == "-":
        sys.stdout.write(text)
        return
    render(Console())
    if json_out:
        write_text(Path(json_out), text)


def emit_report(report: Report, json_out: str | None, junit_xml: Path | None, render, html: Path | None = None) -> None:
    """Print or write the report, then exit with its verdict (0 healthy, 1 findings)."""
    emit_json_or_table(to_json(report), json_out, lambda console: render(report, console))
    if junit_xml:
        write_text(junit_xml, to_junit(report))
    if html:
        from specdoctor.html_report import to_html

        write_text(html, to_html(report))
    raise typer.Exit(report.exit_code)
