"""The HTML report of `check` and `probe` (`--html FILE`): one self-contained file, its charts embedded as SVG
data URIs, for people to look at; the JSON report stays the one for machines."""

from __future__ import annotations

import base64
from html import escape

from specdoctor.charts import bar_chart, line_chart
from specdoctor.probe.output_sweeps import SAMPLING_BINS
from specdoctor.report import CheckReport, ProbeReport, Report, Sweep

STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.verdict { padding: .6em 1em; border-radius: 4px; font-weight: bold; }
.healthy { background: #e3f4e1; } .unhealthy { background: #fbe3e1; }
table { border-collapse: collapse; margin: .6em 0; } td, th { border: 1px solid #ccc; padding: .3em .6em;
vertical-align: top; text-align: left; } .error { color: #b00; font-weight: bold; } .warning { color: #a60; }
.info { color: #666; } img { display: block; margin: .6em 0; }
"""
# Counts the charts that loaded into <body data-loaded>, so a test in a real browser can read it from the DOM.
COUNT_LOADED = """
<script>
for (const image of document.images) {
  const counted = () => { document.body.dataset.loaded = String(Number(document.body.dataset.loaded) + 1); };
  if (image.complete && image.naturalWidth > 0) counted(); else image.addEventListener("load", counted);
}
</script>
"""


def image(svg: str, alt: str) -> str:
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/svg+xml;base64,{data}">'


def position_bars(title: str, rows: dict[str, list[float]]) -> str:
    """Per-position acceptance rates, one series per row (a stage, a sweep's point)."""
    width = max((len(rates) for rates in rows.values()), default=0)
    series = {name: [*rates, *[0.0] * (width - len(rates))] for name, rates in rows.items()}
    return image(bar_chart(title, [f"position {i}" for i in range(width)], series, "acceptance rate", 1.0), title)


def findings_table(report: Report) -> str:
    rows = "".join(
        f'<tr><td class="{f.severity}">{f.severity}</td><td>{escape(f.check)}</td><td>{escape(f.message)}</td>'
        f"<td>{escape(f.hint)}</td></tr>"
        for f in report.all_findings()
    )
    return f"<table><tr><th>severity</th><th>check</th><th>finding</th><th>hint</th></tr>{rows}</table>"


def rates(metrics: dict | None) -> list[float]:
    return list((metrics or {}).get("per_position_acceptance_rate") or [])


def sweep_section(sweep: Sweep) -> str:
    """A sweep's chart: acceptance against context length, per-position bars per point, or the calibration."""
    parts = [f"<h2>{escape(sweep.name)} sweep: {escape(sweep.status)}</h2><p>{escape(sweep.summary)}</p>"]
    measured = [p for p in sweep.points if (p.get("metrics") or {}).get("mean_acceptance_length") is not None]
    if sweep.name == "context" and len(measured) > 1:
        lengths = [float(p["label"].split()[0].replace(",", "")) for p in measured]
        means = [p["metrics"]["mean_acceptance_length"] for p in measured]
        chart = line_chart(
            "acceptance against context length",
            lengths,
            {"mean acceptance length": means},
            "prompt tokens",
            "mean acceptance length",
        )
        parts.append(image(chart, "acceptance against context length"))
    if measured:
        parts.append(
            position_bars(f"{sweep.name}: per-position acceptance", {p["label"]: rates(p["metrics"]) for p in measured})
        )
    for point in (p for p in sweep.points if "observed" in p):
        width = len(point["observed"])  # the reported ranks and the rest, trailing sparse bins folded together
        bins = [f"rank {i + 1}" for i in range(width - 1)] + ["rest" if width > SAMPLING_BINS else f"rank {width} on"]
        series = {"observed": [float(o) for o in point["observed"]], "expected": point["expected"]}
        title = f"sampled tokens by rank, {point['label']} (p = {point['p_value']:.2g})"
        parts.append(image(bar_chart(title, bins, series, "tokens"), title))
    differing = [p for p in sweep.points if p.get("divergence")]
    if differing:
        rows = "".join(
            f"<tr><td>{escape(p['label'])}</td><td>token {p['divergence']['index']}</td></tr>" for p in differing
        )
        parts.append(f"<table><tr><th>prompt</th><th>first difference</th></tr>{rows}</table>")
    checks = [p for p in sweep.points if "verdict" in p]
    if checks:
        rows = "".join(
            f"<tr><td>{escape(p['label'])}</td><td>{p['requests']}</td><td>{escape(p['verdict'])}</td>"
            f"<td>{escape(p['evidence'])}</td></tr>"
            for p in checks
        )
        parts.append(f"<table><tr><th>check</th><th>requests</th><th>verdict</th><th>evidence</th></tr>{rows}</table>")
    return "\n".join(parts)


def body(report: Report) -> tuple[str, str]:
    """(title, the report's own sections)."""
    if isinstance(report, CheckReport):
        stages = {
            f"{row['stage']} ({row['policy']})": list(row["per_position_acceptance_rate"] or [])
            for row in report.comparison()
        }
        chart = position_bars("per-position acceptance, before and after the repair", stages) if stages else ""
        return f"check · {report.model}", chart
    if isinstance(report, ProbeReport):
        battery = (
            position_bars("battery: per-position acceptance", {"battery": rates(report.metrics)})
            if rates(report.metrics)
            else ""
        )
        return f"probe · {report.url} · {report.served_model}", battery + "\n".join(map(sweep_section, report.sweeps))
    raise TypeError(f"no HTML rendering for {type(report).__name__}")


def to_html(report: Report) -> str:
    title, sections = body(report)
    state = "healthy" if report.healthy else "unhealthy"
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>specdoctor {escape(title)}</title>"
        f"<style>{STYLE}</style></head><body data-loaded='0'>"
        f"<h1>specdoctor {escape(title)}</h1><p class='verdict {state}'>verdict: {escape(report.verdict())}</p>"
        f"<h2>findings</h2>{findings_table(report)}{sections}{COUNT_LOADED}</body></html>\n"
    )
