"""`probe` from start to end: the battery (acceptance, greedy), then each sweep asked for, within one budget."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from specdoctor.battery import load_battery, prompt_of
from specdoctor.checks.acceptance import bigram_baseline
from specdoctor.errors import SpecdoctorError
from specdoctor.probe.acceptance_sweeps import concurrency_sweep, context_sweep, prefix_cache_sweep
from specdoctor.probe.api_sweep import api_sweep
from specdoctor.probe.client import Probe, Served, error_findings, first_choice, probe_findings
from specdoctor.probe.options import ProbeOptions
from specdoctor.probe.output_sweeps import reference_sweep, sampling_sweep
from specdoctor.probe.pace import BudgetSpent
from specdoctor.probe.verdicts import not_run
from specdoctor.report import Finding, ProbeReport, Sweep


def run_probe(options: ProbeOptions) -> ProbeReport:
    probe = Probe(options)
    battery = load_battery(options.battery)
    served = probe.served_model(options.model)
    prompts = [prompt_of(entry) for entry in battery]
    window = probe.measure(served.model, prompts)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items() if k != "api_key"}
    findings = error_findings(window.errors, len(battery))
    outputs = [first_choice(reply).get("token_ids") for reply in window.replies]
    baseline = bigram_baseline(outputs) if window.replies and all(isinstance(o, list) for o in outputs) else None
    if window.replies:
        findings += probe_findings(
            window.source, window.metrics, options.min_acceptance_length, served.engine, baseline
        )
    answered = f"{len(window.replies)}/{len(battery)} answered"
    metrics = window.figures()["metrics"]
    report = ProbeReport(options.url, served.model, served.engine, settings, window.source, answered, metrics, findings)
    report.sweeps = run_sweeps(probe, served, battery, prompts, baseline)
    if options.sweeps.every_sweep and not options.sweeps.reference_url:
        message = "reference: not run (no --reference-url): greedy output was not compared with speculation off"
        report.findings.append(Finding("probe.reference", "info", message, stage="probe"))
    return report


def run_sweeps(probe: Probe, served: Served, battery: list[dict], prompts: list, baseline: float | None) -> list[Sweep]:
    """Every sweep asked for (`prompts`: the battery's, as sent); once the budget is spent the rest are not run."""
    options = probe.options.sweeps
    runs = {
        "context": lambda: context_sweep(probe, served, options, baseline),
        "prefix-cache": lambda: prefix_cache_sweep(probe, served, options),
        "concurrency": lambda: concurrency_sweep(probe, served, options),
        "sampling": lambda: sampling_sweep(probe, served, options, prompts),
        "reference": lambda: reference_sweep(probe, served, options, battery, prompts),
        "api": lambda: api_sweep(probe, served, options, prompts),
    }
    sweeps, spent = [], None
    for name in options.asked:
        if spent:
            sweeps.append(not_run(name, spent))
            continue
        try:
            sweeps.append(runs[name]())
        except BudgetSpent as err:
            spent = str(err)
            sweeps.append(not_run(name, spent))
        except SpecdoctorError as err:  # e.g. the reference server cannot be reached: this sweep only
            sweeps.append(not_run(name, str(err)))
    return sweeps
