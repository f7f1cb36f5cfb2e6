"""Command-line entry point: registers one command per module of `specdoctor.commands`.

Exit codes: 0 healthy, 1 findings, 2 bad usage or unreadable input (one line on stderr, no traceback);
130 stopped by Ctrl-C (SIGINT), 143 by SIGTERM.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import typer
from rich.console import Console

from specdoctor.commands import bench, check, generate, inspect, probe, serve
from specdoctor.commands.options import PASS_THROUGH
from specdoctor.errors import SpecdoctorError
from specdoctor.report import CheckReport, ProbeReport, Report, error_report
from specdoctor.workflow.bench import SCHEMA as BENCH_SCHEMA

try:  # typer >= 0.25 parses with its own copy of click, and raises that copy's exceptions
    from typer._click import exceptions as click_exceptions
except ImportError:
    from click import exceptions as click_exceptions

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_show_locals=False,
    no_args_is_help=True,
    help="Find and repair silent failures in speculative-decoding deployments.",
)
app.command("check", context_settings=PASS_THROUGH)(check.check)
app.command("repair")(check.repair)
app.command("serve", context_settings=PASS_THROUGH)(serve.serve)
app.command("probe")(probe.probe)
app.command("inspect")(inspect.inspect)
app.command("generate")(generate.generate)
app.command("bench")(bench.bench)


# The commands whose --json takes a destination (FILE or -), and the schema of their report.
JSON_REPORTS = {
    "check": CheckReport.schema,
    "repair": CheckReport.schema,
    "probe": ProbeReport.schema,
    "bench": BENCH_SCHEMA,
}


def write_error_report(argv: list[str], message: str, partial: Report | None = None) -> None:
    """With `--json FILE|-`, a report is written on every exit, exit 2 included (an `error` object, after what
    the run had found before the error)."""
    if not argv or argv[0] not in JSON_REPORTS or "--json" not in argv[:-1]:
        return
    destination = argv[argv.index("--json") + 1]
    text = error_report(JSON_REPORTS[argv[0]], message, partial)
    if destination == "-":
        sys.stdout.write(text)
        return
    try:
        Path(destination).write_text(text, encoding="utf-8")
    except OSError:
        pass  # the one-line error below is all that can be said


def fail(message: str, partial: Report | None = None) -> None:
    write_error_report(sys.argv[1:], message, partial)
    Console(stderr=True).print(f"specdoctor: error: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(2)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so the same clean-up (stopping the
    ranks, closing files) runs for both, wherever the command was (loading, compiling, decoding, serving)."""

    received = False  # typer turns both into exit code 130; this tells them apart


def raise_terminated(_signum, _frame) -> None:
    Terminated.received = True
    raise Terminated


def main() -> None:
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        code = app(standalone_mode=False)
    except SpecdoctorError as err:
        fail(str(err), getattr(err, "report", None))  # a check that stopped part-way keeps what it found
    except click_exceptions.NoArgsIsHelpError as err:
        Console(stderr=True).print(err.ctx.get_help(), markup=False, highlight=False)
        sys.exit(2)
    except click_exceptions.UsageError as err:  # a bad or missing flag: one line, as for every other user error
        fail(err.format_message())
    except (typer.Abort, KeyboardInterrupt):  # one that arrived outside the command (typer's own code)
        code = 130
    code = code if isinstance(code, int) else 0
    sys.exit(143 if code == 130 and Terminated.received else code)
