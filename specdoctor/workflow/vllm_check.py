"""`check --engine vllm`: the same pre-flight, then the user's vLLM started with specdoctor's plugin on: every
worker's drafter tables against the checkpoint rows its slice must hold, the battery through vLLM with its
per-request speculative counters, against the same vLLM with speculation off (lossless, with check's rounding-tie
rule); with --repair, the workers repair in place and the battery runs again. All of it lands in check's report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import Progress

from specdoctor.engines.vllm import launch
from specdoctor.errors import SpecdoctorError
from specdoctor.report import CheckReport, Finding, StageResult
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.workflow.check import CheckOptions, placement_row, settings_dict
from specdoctor.workflow.drafter import CheckClock, preflight_findings, skipped
from specdoctor.workflow.vllm_args import TRANSLATED, vllm_arguments, without_speculation

HINT = "vLLM's worker holds the wrong rows: specdoctor check --engine vllm --repair repairs them in the workers, "
HINT += "and specdoctor serve --engine vllm serves with them repaired"


@dataclass(frozen=True)
class VllmCheckOptions:
    check: CheckOptions
    vllm_args: list[str] = field(default_factory=list)  # the user's own vLLM flags, passed through
    timeout: float = 1800.0  # seconds each vLLM start may take, battery included


@dataclass
class WorkerRepairs:
    """What the workers read into their drafter tables: {worker: {tensor: checkpoint key}}; bytes read by all of
    them, and the slowest worker's seconds (they repair at once)."""

    repaired: dict[str, dict[str, str]]
    bytes_read: int
    seconds: float


def run_vllm_check(options: VllmCheckOptions, show_progress: bool) -> CheckReport:
    from specdoctor.battery import battery_prompts
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.checkpoint.tokenizer import load_codec
    from specdoctor.runtime.drafter.registry import drafter_kind, speculative_tokens
    from specdoctor.runtime.partition import placements

    runtime = options.check.runtime
    checkpoint = Checkpoint(runtime.model)
    drafter = drafter_kind(checkpoint, runtime.model, runtime.speculative_model, runtime.speculative_method)
    k = speculative_tokens(drafter, runtime.num_speculative_tokens)
    dataclasses.replace(options.check, runtime=dataclasses.replace(runtime, num_speculative_tokens=k)).validate()
    version = launch.installed_vllm()
    ranks = placements(checkpoint.config, runtime.pp, runtime.pp_partition, has_drafter=drafter is not None)
    applied = {name: value for name, value in settings_dict(runtime).items() if name in TRANSLATED}
    settings = {**applied, **settings_dict(options.check), "engine": "vllm", "vllm": version}
    settings["num_speculative_tokens"] = k
    report = CheckReport(
        str(checkpoint.path),
        settings,
        [placement_row(r, runtime.tp) for r in ranks],
        preflight_findings(checkpoint, ranks, drafter),
    )
    if drafter is None:
        return report  # nothing to run: the pre-flight error says why
    arguments = vllm_arguments(runtime, checkpoint, drafter, k, options.vllm_args, token_ids_only=True)
    settings["vllm_args"] = arguments
    prompts, fallback = battery_prompts(options.check.battery, checkpoint, load_codec(checkpoint, runtime.tokenizer))
    if fallback:
        report.preflight.append(Finding("behaviour.battery", "warning", fallback, stage="preflight"))
    clock = CheckClock(report.timings)
    try:
        with Progress(console=Console(stderr=True), disable=not show_progress, transient=True) as progress:
            progress.add_task(f"vLLM: {len(prompts)} prompts with speculation (plugin on), then without", total=None)
            request = {"prompts": prompts, "max_tokens": options.check.max_tokens}
            speculative = {"vllm_args": arguments, "speculative": True, "examine": True, "repair": options.check.repair}
            plain = {"vllm_args": without_speculation(arguments), "speculative": False, "examine": False}
            served, reference = launch.run_driver([request | speculative, request | plain], options.timeout)
            clock.lap("vllm")
        record_vllm_run(report, options, served, reference, k, checkpoint.config)
    except launch.VllmStopped as err:  # what the workers found as they loaded is reported all the same
        if err.reports:
            tables = [f for r in err.reports.values() for f in table_findings(r, "tables", "before")]
            not_run = skipped("the battery through vLLM", str(err), "before")
            behaviour = {"battery": "not run", "lossless": [], "metrics": None}
            report.stages.append(StageResult("before", "vllm", [*tables, not_run], {"workers": err.reports}, behaviour))
        err.report = report
        raise
    except SpecdoctorError as err:
        err.report = report  # the findings computed before the error are written with it
        raise
    return report


def record_vllm_run(report: CheckReport, options: VllmCheckOptions, served, reference, k, config) -> None:
    """The workers' reports and the battery before, the repair, and both after it, into the report."""
    missing = launch.missing_workers(served["reports"], served["tp"], served["pp"])
    if missing:
        report.preflight += [worker_finding(name, "never wrote its report: it is not verified") for name in missing]
        raise SpecdoctorError(
            f"--engine vllm: worker(s) {', '.join(missing)} never reported (is specdoctor installed where vLLM's "
            f"workers run, and VLLM_PLUGINS allowing it? vLLM's log: {served.get('log')})"
        )
    reports = served["reports"]
    stages = [("before", "vllm", [table_findings(r, "tables", "before") for r in reports.values()], reports)]
    if options.check.repair:
        repairs = served["repairs"]
        report.repair_findings = [f for r in repairs for f in repair_findings(r)]
        done = [r["repair"] for r in repairs if "repair" in r]
        report.repair = WorkerRepairs(
            {label(r): r["repair"]["repaired"] for r in repairs if r.get("repair", {}).get("repaired")},
            sum(d["bytes_read"] for d in done),
            max((d["seconds"] for d in done), default=0.0),
        )
        after = {f"tp{r['worker']['tp_rank']}-pp{r['worker']['pp_rank']}": r for r in repairs}
        stages.append(("after", "repaired", [table_findings(r, "after", "after") for r in repairs], after))
    for (name, policy, tables, workers), answers in zip(stages, (served["before"], served.get("after")), strict=False):
        behaviour = battery_behaviour(answers, reference, options, k, config, name, served["dtype"])
        findings = [f for group in tables for f in group] + behaviour.pop("findings")
        report.stages.append(StageResult(name, policy, findings, {"workers": workers}, behaviour))


def label(report: dict) -> str:
    return report["worker"]["label"]  # as the worker named itself (WorkerPlace.label)


def worker_finding(name: str, message: str) -> Finding:
    return Finding("engine.worker", "error", f"vLLM worker {name}: {message}", stage="before", data={"worker": name})


def table_findings(report: dict, which: str, stage: str) -> list[Finding]:
    """One finding per drafter table of one worker (or the error that stopped its examination)."""
    where = label(report)
    if "error" in report:
        return [Finding("engine.worker", "error", f"vLLM worker {where}: {report['error']}", stage=stage)]
    if not report.get("has_drafter"):
        return [Finding("engine.worker", "info", f"vLLM worker {where} holds no drafter", stage=stage)]
    findings = []
    for table in report[which]:
        data = {"worker": report["worker"], **table}
        if table["ok"]:
            message = f"{table['tensor']} on vLLM worker {where} holds {table['key']}'s rows {table['rows']}"
            findings.append(Finding("drafter.fingerprint", "info", message, stage=stage, data=data))
        else:
            message = f"{table['tensor']} on vLLM worker {where}: {table['problem']}"
            findings.append(Finding("drafter.fingerprint", "error", message, HINT, stage, data))
    return findings


def repair_findings(report: dict) -> list[Finding]:
    if "error" in report:
        return [Finding("repair", "error", f"vLLM worker {label(report)}: {report['error']}", stage="repair")]
    repair = report.get("repair") or {"repaired": {}}
    return [
        Finding("repair", "info", f"filled {name} from {key} on vLLM worker {label(report)}", stage="repair")
        for name, key in repair["repaired"].items()
    ]


def battery_behaviour(answers, reference, options: VllmCheckOptions, k: int, config, stage: str, dtype: str) -> dict:
    """The behaviour stage from vLLM's own numbers: its per-request counters summed, and its tokens against the
    reference's (speculation off), with the reference's raw logits for the rounding-tie rule."""
    import torch

    from specdoctor.checks.acceptance import bigram_baseline
    from specdoctor.checks.behaviour import behaviour_findings

    plain = [answer["tokens"] for answer in reference["before"]]
    tokens = [answer["tokens"] for answer in answers]
    metrics = SpecMetrics()
    for answer in answers:
        metrics.add(SpecMetrics(**answer["spec"]))
    lossless = [a == b for a, b in zip(plain, tokens, strict=True)]
    divergences = [
        divergence(
            row, plain[row], tokens[row], reference["before"][row]["logits"], torch.finfo(getattr(torch, dtype)).eps
        )
        for row, same in enumerate(lossless)
        if not same
    ]
    metrics_dict, baseline = metrics.to_dict(), bigram_baseline(plain)
    recurrent = sum(config.is_linear_attention(i) for i in range(config.num_hidden_layers))
    findings = behaviour_findings(
        lossless,
        metrics_dict,
        {"count": 0},  # vLLM does not hand back its drafts: the constant-proposal check is specdoctor's runtime's
        k,
        options.check.min_acceptance_length,
        stage,
        baseline,
        recurrent,
        divergences,
    )
    return {
        "battery": f"{sum(lossless)}/{len(lossless)}",
        "lossless": lossless,
        "divergences": divergences,
        "metrics": metrics_dict,
        "per_prompt": [answer["spec"] for answer in answers],
        "bigram_baseline": baseline,
        "findings": findings,
    }


def divergence(row: int, plain: list[int], speculative: list[int], logits: list[dict], eps: float) -> dict:
    """check's divergence evidence from the reference's raw logits where the outputs first differ (its top
    tokens and the one it chose: a token outside them is no near-tie)."""
    from specdoctor.checks.behaviour import first_difference, tie_record

    at = first_difference(plain, speculative)
    emitted = [output[at] if at < len(output) else None for output in (plain, speculative)]
    scores = {int(token): logit for token, logit in logits[at].items()} if at < len(logits) else {}
    chosen = [scores.get(token) for token in emitted]
    return tie_record(row, at, emitted, chosen, max(scores.values(), default=0.0), eps)
