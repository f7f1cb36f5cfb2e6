"""Findings and the reports of `check` and `probe`, rendered for people (rich), machines (JSON) and
CI (JUnit XML). Both kinds share the verdict: exit 0 without error findings, else 1."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from rich.console import Console
from rich.table import Table

STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


@dataclass
class Finding:
    check: str  # stable id, e.g. "drafter.provenance"
    severity: str  # error | warning | info
    message: str  # one line: what is wrong (or what was found)
    hint: str = ""  # one line: what to do about it
    stage: str = ""  # preflight | before | repair | after | probe
    data: dict = field(default_factory=dict)


# The two independent kinds of evidence about a drafter: its weights' content against the checkpoint (and,
# for a block drafter, its taps' content against the target layers' states), and its behaviour. The runtime's
# own provenance label is context, not evidence about an engine.
CONTENT_SIGNALS = ("drafter.alias", "drafter.stats", "drafter.fingerprint", "drafter.taps")
BEHAVIOUR_SIGNALS = (
    "behaviour.acceptance",
    "behaviour.block",
    "behaviour.constant_proposals",
    "behaviour.crash",
    "behaviour.lossless",
    "behaviour.state_rollback",
)


@dataclass
class StageResult:
    """One run of the loaded-drafter and behaviour stages (before or after the repair)."""

    name: str
    policy: str
    findings: list[Finding] = field(default_factory=list)
    drafter: dict = field(default_factory=dict)
    behaviour: dict = field(default_factory=dict)

    def signals(self) -> dict[str, list[str]]:
        """The content and behaviour checks that found an error in this stage."""
        errors = {f.check for f in self.findings if f.severity == "error"}
        return {
            "content": [c for c in CONTENT_SIGNALS if c in errors],
            "behaviour": [c for c in BEHAVIOUR_SIGNALS if c in errors],
        }


class Report:
    """What every report kind has: findings in the order they happened, the ones the verdict rests on."""

    schema: ClassVar[str]

    def all_findings(self) -> list[Finding]:
        raise NotImplementedError

    def final_findings(self) -> list[Finding]:
        return self.all_findings()

    @property
    def healthy(self) -> bool:
        return not any(f.severity == "error" for f in self.final_findings())

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def verdict(self) -> str:
        errors = [f for f in self.final_findings() if f.severity == "error"]
        return f"{len(errors)} error finding(s): {errors[0].message}" if errors else "healthy"

    def verdict_dict(self) -> dict:
        return {"healthy": self.healthy, "exit_code": self.exit_code, "summary": self.verdict()}


@dataclass
class CheckReport(Report):
    schema: ClassVar[str] = "specdoctor.check/1"
    model: str
    settings: dict
    placement: list[dict]
    preflight: list[Finding] = field(default_factory=list)
    stages: list[StageResult] = field(default_factory=list)
    repair: object | None = None  # a RepairResult (runtime/drafter/repair.py), or vLLM workers' WorkerRepairs
    repair_findings: list[Finding] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage
    memory: dict | None = None  # the memory plan (runtime/memory.py), where the runtime stages were planned

    def final_findings(self) -> list[Finding]:
        """Pre-flight, plus the last stage run (after the repair when there was one)."""
        return self.preflight + self.repair_findings + (self.stages[-1].findings if self.stages else [])

    def all_findings(self) -> list[Finding]:
        """In the order things happened: pre-flight, before, repair, after."""
        groups = [stage.findings for stage in self.stages] or [[]]
        return self.preflight + groups[0] + self.repair_findings + [f for group in groups[1:] for f in group]

    def verdict(self) -> str:
        """What was verified: a stage that did not run makes it "not verified", naming what did and did not."""
        final = self.final_findings()
        skipped = [f for f in final if f.check == "runtime.skipped"]
        if skipped:
            ran = ["pre-flight", *(["loaded drafter"] if self.stages else []), *(["repair"] if self.repair else [])]
            others = [f for f in final if f.severity == "error" and f.check != "runtime.skipped"]
            found = f"; {len(others)} other error finding(s): {others[0].message}" if others else ""
            not_run = "; ".join(f"{f.data['stages']}: {f.data['reason']}" for f in skipped)
            return f"not verified: checked {', '.join(ran)}; not run: {not_run}{found}"
        verdict = super().verdict()
        return "healthy after repair" if verdict == "healthy" and self.repair else verdict

    def comparison(self) -> list[dict]:
        rows = []
        for stage in self.stages:
            metrics = stage.behaviour["metrics"] or {}  # none when the battery crashed the pipeline
            rows.append(
                {
                    "stage": stage.name,
                    "policy": stage.policy,
                    "mean_acceptance_length": metrics.get("mean_acceptance_length"),
                    "acceptance_rate": metrics.get("acceptance_rate"),
                    "per_position_acceptance_rate": metrics.get("per_position_acceptance_rate"),
                    "battery": stage.behaviour["battery"],
                }
            )
        return rows

    def to_dict(self) -> dict:
        return {
            "schema": self.schema,
            "model": self.model,
            "settings": self.settings,
            "placement": self.placement,
            "preflight": [asdict(f) for f in self.preflight],
            "stages": [{**asdict(s), "signals": s.signals()} for s in self.stages],
            "repair": asdict(self.repair) if self.repair is not None else None,
            "repair_findings": [asdict(f) for f in self.repair_findings],
            "comparison": self.comparison(),
            "timings": self.timings,
            "memory": self.memory,
            "findings": [asdict(f) for f in self.all_findings()],
            "verdict": self.verdict_dict(),
        }


NOT_RUN = "not run"


@dataclass
class Sweep:
    """One of probe's sweeps (probe/acceptance_sweeps.py, probe/output_sweeps.py): its points (one group of
    requests each, e.g. a context-length bucket) and its findings; a sweep the server could not support is
    NOT_RUN, with the reason."""

    name: str  # context | prefix-cache | concurrency | sampling | reference
    status: str  # passed | failed | NOT_RUN
    summary: str  # one line: what was measured, or why it was not run
    source: str | None = None  # where acceptance figures came from: per-request, sglang, metrics
    points: list[dict] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)


@dataclass
class ProbeReport(Report):
    schema: ClassVar[str] = "specdoctor.probe/2"
    url: str
    served_model: str
    engine: str  # what /v1/models says owns the model: vllm, sglang, specdoctor, ...
    settings: dict
    source: str  # where the battery's acceptance figures came from: per-request, sglang, metrics or none
    battery: str  # "n/n answered"
    metrics: dict | None  # vLLM's counters and derived rates for the battery (None: none offered)
    findings: list[Finding] = field(default_factory=list)  # the battery's
    sweeps: list[Sweep] = field(default_factory=list)  # the sweeps asked for, in the order they ran

    def all_findings(self) -> list[Finding]:
        return self.findings + [f for sweep in self.sweeps for f in sweep.findings]

    def verdict(self) -> str:
        """A sweep that was asked for and not run makes the verdict "not verified", naming it and why."""
        not_run = [s for s in self.sweeps if s.status == NOT_RUN]
        if not not_run:
            return super().verdict()
        others = [f for f in self.all_findings() if f.severity == "error" and not f.data.get("not_run")]
        found = f"; {len(others)} error finding(s): {others[0].message}" if others else ""
        return "not verified: " + "; ".join(f"{s.name}: {s.summary}" for s in not_run) + found

    def to_dict(self) -> dict:
        return {
            "schema": self.schema,
            "url": self.url,
            "model": self.served_model,
            "engine": self.engine,
            "settings": self.settings,
            "source": self.source,
            "battery": self.battery,
            "metrics": self.metrics,
            "sweeps": [asdict(s) for s in self.sweeps],
            "findings": [asdict(f) for f in self.all_findings()],
            "verdict": self.verdict_dict(),
        }


def error_report(schema: str, message: str, partial: Report | None = None) -> str:
    """The JSON of a run that stopped on an error (exit 2): what went wrong, as one line, with everything the
    run had found before it (`partial`, where it had begun a report)."""
    verdict = {"healthy": False, "exit_code": 2, "summary": message}
    found = partial.to_dict() if partial is not None else {"schema": schema}
    return json.dumps({**found, "error": {"message": message}, "verdict": verdict}, indent=2) + "\n"


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


def to_junit(report: Report) -> str:
    """One test case per check and stage; error findings are failures carrying their message."""
    cases: dict[tuple[str, str], list[Finding]] = {}
    for finding in report.all_findings():
        cases.setdefault((finding.stage, finding.check), []).append(finding)
    failures = sum(any(f.severity == "error" for f in group) for group in cases.values())
    suite = ET.Element("testsuite", name=report.schema.split("/")[0], tests=str(len(cases)), failures=str(failures))
    for (stage, check), group in cases.items():
        case = ET.SubElement(suite, "testcase", classname=f"specdoctor.{stage}", name=check)
        errors = [f for f in group if f.severity == "error"]
        if errors:
            failure = ET.SubElement(case, "failure", message=errors[0].message, type="error")
            failure.text = "\n".join(f"{f.message} (hint: {f.hint})" if f.hint else f.message for f in errors)
        others = [f"{f.severity}: {f.message}" for f in group if f.severity != "error"]
        if others:
            ET.SubElement(case, "system-out").text = "\n".join(others)
    return ET.tostring(ET.ElementTree(suite).getroot(), encoding="unicode", xml_declaration=True) + "\n"


def placement_table(rows: list[dict]) -> Table:
    """The pipeline stages (rows of `placement_row`): each one's ranks (TP ranks inner), layers and what it holds."""
    tp = len(rows[0].get("ranks", [0])) if rows else 1
    table = Table(title=f"Placement · TP {tp} × PP {len(rows)}")
    for column in ("stage", "ranks", "layers", "embedding", "head", "drafter"):
        table.add_column(column)
    for row in rows:
        start, stop = row["layers"]
        flags = ("yes" if row[key] else "-" for key in ("has_embedding", "has_head", "has_drafter"))
        ranks = ", ".join(map(str, row.get("ranks", [row["rank"]])))
        table.add_row(str(row["rank"]), ranks, f"[{start}, {stop})", *flags)
    return table


def findings_table(title: str, findings: list[Finding]) -> Table:
    table = Table(title=title, show_lines=False)
    for column in ("severity", "check", "finding", "hint"):
        table.add_column(column, overflow="fold")
    for finding in findings:
        style = STYLE[finding.severity]
        table.add_row(f"[{style}]{finding.severity}[/{style}]", finding.check, finding.message, finding.hint)
    return table


def acceptance_row(metrics: dict | None) -> list[str]:
    """mean acceptance length, acceptance rate and per-position rates, as table cells ("-" where unknown)."""
    metrics = metrics or {}
    mean, rate = metrics.get("mean_acceptance_length"), metrics.get("acceptance_rate")
    return [
        "-" if mean is None else f"{mean:.2f}",
        "-" if rate is None else f"{rate:.1%}",
        " ".join(f"{r:.0%}" for r in metrics.get("per_position_acceptance_rate") or []) or "-",
    ]


def render_verdict(report: Report, console: Console) -> None:
    style = "bold green" if report.healthy else "bold red"
    console.print(f"[{style}]verdict: {report.verdict()}[/{style}]")
