"""How a sweep's outcome becomes a report entry: passed, failed, or not run with the reason (never passed)."""

from __future__ import annotations

from specdoctor.report import NOT_RUN, Finding, Sweep

NOT_RUN_HINT = "the sweep was asked for: what it checks is not verified"


def point(label: str, window) -> dict:
    """One group of requests (a probe.client.Window) as the report shows it."""
    return {"label": label, **window.figures()}


def sweep_of(name: str, summary: str, source: str | None, points: list[dict], findings: list[Finding]) -> Sweep:
    """A sweep that ran: failed when it has an error finding. Its summary is an info finding of its own, so every
    sweep is one JUnit test case (probe.NAME) whatever it found."""
    status = "failed" if any(f.severity == "error" for f in findings) else "passed"
    summary_finding = Finding(f"probe.{name}", "info", summary, stage=name)
    return Sweep(name, status, summary, source, points, [summary_finding, *findings])


def not_run(name: str, reason: str, source: str | None = None, points: list[dict] | None = None) -> Sweep:
    finding = Finding(
        f"probe.{name}", "error", f"{name} sweep not run: {reason}", NOT_RUN_HINT, name, {"not_run": reason}
    )
    return Sweep(name, NOT_RUN, reason, source, points or [], [finding])
