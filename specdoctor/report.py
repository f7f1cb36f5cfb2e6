"""Findings and the check report, rendered for people (rich), machines (JSON) and CI (JUnit XML)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field

from rich.console import Console
from rich.table import Table

SCHEMA = "specdoctor.check/1"
SEVERITIES = ("error", "warning", "info")
STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


@dataclass
class Finding:
    check: str  # stable id, e.g. "drafter.provenance"
    severity: str  # error | warning | info
    message: str  # one line: what is wrong (or what was found)
    hint: str = ""  # one line: what to do about it
    stage: str = ""  # preflight | before | repair | after
    data: dict = field(default_factory=dict)


@dataclass
class StageResult:
    """One run of the loaded-drafter and behaviour stages (before or after the repair)."""

    name: str
    policy: str
    findings: list[Finding] = field(default_factory=list)
    drafter: dict = field(default_factory=dict)
    behaviour: dict = field(default_factory=dict)


@dataclass
class Report:
    model: str
    settings: dict
    placement: list[dict]
    preflight: list[Finding] = field(default_factory=list)
    stages: list[StageResult] = field(default_factory=list)
    repair: dict | None = None
    repair_findings: list[Finding] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage

    @property
    def final_findings(self) -> list[Finding]:
        """What the verdict rests on: pre-flight, plus the last stage run (after the repair when there was one)."""
        return self.preflight + self.repair_findings + (self.stages[-1].findings if self.stages else [])

    @property
    def healthy(self) -> bool:
        return not any(f.severity == "error" for f in self.final_findings)

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def verdict(self) -> str:
        errors = [f for f in self.final_findings if f.severity == "error"]
        if not errors:
            return "healthy after repair" if self.repair else "healthy"
        return f"{len(errors)} error finding(s): {errors[0].message}"

    def comparison(self) -> list[dict]:
        rows = []
        for stage in self.stages:
            metrics = stage.behaviour.get("metrics") or {}  # a probe of a server without counters has none
            rows.append(
                {
                    "stage": stage.name,
                    "policy": stage.policy,
                    "mean_acceptance_length": metrics.get("mean_acceptance_length"),
                    "acceptance_rate": metrics.get("acceptance_rate"),
                    "per_position_acceptance_rate": metrics.get("per_position_acceptance_rate"),
                    "battery": stage.behaviour.get("battery"),
                }
            )
        return rows

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "model": self.model,
            "settings": self.settings,
            "placement": self.placement,
            "preflight": [asdict(f) for f in self.preflight],
            "stages": [asdict(s) for s in self.stages],
            "repair": self.repair,
            "repair_findings": [asdict(f) for f in self.repair_findings],
            "comparison": self.comparison(),
            "timings": self.timings,
            "findings": [asdict(f) for f in self.all_findings()],
            "verdict": {"healthy": self.healthy, "exit_code": self.exit_code, "summary": self.verdict()},
        }

    def all_findings(self) -> list[Finding]:
        """In the order things happened: pre-flight, before, repair, after."""
        groups = [stage.findings for stage in self.stages] or [[]]
        return self.preflight + groups[0] + self.repair_findings + [f for group in groups[1:] for f in group]


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2) + "\n"


def to_junit(report: Report) -> str:
    """One test case per check and stage; error findings are failures carrying their message."""
    cases: dict[tuple[str, str], list[Finding]] = {}
    for finding in report.all_findings():
        cases.setdefault((finding.stage, finding.check), []).append(finding)
    failures = sum(any(f.severity == "error" for f in group) for group in cases.values())
    suite = ET.Element("testsuite", name="specdoctor.check", tests=str(len(cases)), failures=str(failures))
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


def findings_table(title: str, findings: list[Finding]) -> Table:
    table = Table(title=title, show_lines=False)
    for column in ("severity", "check", "finding", "hint"):
        table.add_column(column, overflow="fold")
    for finding in findings:
        style = STYLE[finding.severity]
        table.add_row(f"[{style}]{finding.severity}[/{style}]", finding.check, finding.message, finding.hint)
    return table


def render_human(report: Report, console: Console) -> None:
    if report.placement:  # a probe of a live server has no placement or pre-flight of its own
        placement = Table(title=f"Placement · PP {report.settings['pp']}")
        for column in ("rank", "layers", "embedding", "head", "drafter"):
            placement.add_column(column)
        for rank in report.placement:
            start, stop = rank["layers"]
            placement.add_row(
                str(rank["rank"]),
                f"[{start}, {stop})",
                *("yes" if rank[key] else "-" for key in ("has_embedding", "has_head", "has_drafter")),
            )
        console.print(placement)
        console.print(findings_table("Pre-flight (headers only)", report.preflight))
    for stage in report.stages:
        console.print(findings_table(f"Loaded drafter and battery · {stage.name} · {stage.policy}", stage.findings))
        if stage.name == "before" and report.repair is not None:
            repaired = report.repair_findings or [Finding("repair", "info", "nothing needed repair", stage="repair")]
            console.print(
                findings_table(
                    f"Repair · {report.repair['bytes_read']:,} bytes read in {report.repair['seconds']:.3f} s", repaired
                )
            )
    comparison = Table(title="Before / after (mean acceptance length counts the bonus token)")
    for column in ("stage", "policy", "mean acceptance length", "acceptance rate", "per-position rates", "battery"):
        comparison.add_column(column)
    for row in report.comparison():
        rates = row["per_position_acceptance_rate"] or []
        comparison.add_row(
            row["stage"],
            row["policy"],
            "-" if row["mean_acceptance_length"] is None else f"{row['mean_acceptance_length']:.2f}",
            "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.1%}",
            " ".join(f"{r:.0%}" for r in rates) or "-",
            row["battery"] or "-",
        )
    console.print(comparison)
    style = "bold green" if report.healthy else "bold red"
    console.print(f"[{style}]verdict: {report.verdict()}[/{style}]")
