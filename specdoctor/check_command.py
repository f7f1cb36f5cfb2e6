"""`specdoctor check`: pre-flight, loaded drafter, battery; then, with --repair, the same after the repair."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from specdoctor.checks.behaviour import DEFAULT_MIN_ACCEPTANCE_LENGTH, load_battery, run_battery
from specdoctor.checks.preflight import preflight
from specdoctor.errors import SpecdoctorError
from specdoctor.report import Finding, Report, StageResult
from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.partition import placements
from specdoctor.runtime.tokenizer import TextCodec


@dataclass(frozen=True)
class CheckOptions:
    model: str
    pp: int = 1
    pp_partition: str | None = None
    num_speculative_tokens: int = 3
    drafter_policy: str = "engine-legacy"  # what an unpatched engine does with this checkpoint at this PP size
    head_policy: str = "engine-legacy"
    fill: str = "empty"
    repair: bool = False
    battery: Path | None = None
    min_acceptance_length: float = DEFAULT_MIN_ACCEPTANCE_LENGTH
    max_tokens: int = 32
    tp_size: int = 1
    tp_rank: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    timeout_s: float = 60.0

    def validate(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 8:
            raise SpecdoctorError(f"--num-speculative-tokens must be in 1..8, got {self.num_speculative_tokens}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise SpecdoctorError(f"--tp-rank {self.tp_rank} is outside 0..{self.tp_size - 1}")
        if self.max_tokens < 1:
            raise SpecdoctorError("--max-tokens must be at least 1")


def run_check(options: CheckOptions, show_progress: bool) -> Report:
    options.validate()
    checkpoint = Checkpoint(options.model)
    ranks = placements(checkpoint.config, options.pp, options.pp_partition)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()}
    report = Report(str(checkpoint.path), settings, [], preflight(checkpoint, ranks))
    report.placement = [
        {
            "rank": r.rank,
            "layers": [r.layers.start, r.layers.stop],
            "has_embedding": r.has_embedding,
            "has_head": r.has_head,
            "has_drafter": r.has_drafter,
        }
        for r in ranks
    ]
    if checkpoint.config.num_nextn_predict_layers == 0:
        return report  # nothing to run: the pre-flight error says why
    battery = load_battery(options.battery)
    codec = TextCodec(checkpoint.path, checkpoint.config.eos_token_ids)
    prompts = [codec.encode(entry["prompt"]) for entry in battery]
    steps = 4 + (3 if options.repair else 0)
    clock = StageClock(report.timings)
    with Progress(console=Console(stderr=True), disable=not show_progress, transient=True) as progress:
        task = progress.add_task(f"starting {options.pp} pipeline rank(s)", total=steps)
        with Engine.from_options(options, checkpoint) as engine:
            clock.lap("start_ranks")
            progress.update(task, advance=1, description=f"battery: target only ({len(prompts)} prompts)")
            plain = engine.generate(prompts, options.max_tokens, num_speculative_tokens=0).tokens
            clock.lap("target_only_battery")
            progress.advance(task)
            before = run_stage(engine, "before", options.drafter_policy, options, prompts, plain, progress, task)
            report.stages.append(before)
            clock.lap("before")
            if options.repair:
                progress.update(task, description="repair: reading the drafter's tensors from the checkpoint")
                report.repair = engine.drafter_command(
                    "repair_drafter", names=before.drafter["broken"], tp_size=options.tp_size, tp_rank=options.tp_rank
                )
                report.repair_findings = repair_findings(report.repair)
                clock.lap("repair")
                progress.advance(task)
                if report.repair["repaired"]:
                    after = run_stage(engine, "after", "repaired", options, prompts, plain, progress, task)
                    report.stages.append(after)
                    clock.lap("after")
        clock.lap("stop_ranks")
    return report


class StageClock:
    """Seconds spent in each stage of a check, recorded into the report."""

    def __init__(self, timings: dict[str, float]):
        self.timings, self.last = timings, time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.timings[stage] = round(now - self.last, 3)
        self.last = now


def run_stage(engine, name, policy, options, prompts, plain, progress, task) -> StageResult:
    progress.update(task, description=f"{name}: inspecting the loaded drafter")
    drafter = engine.drafter_command("inspect_drafter", stage=name)
    progress.update(task, advance=1, description=f"{name}: battery with speculative decoding")
    behaviour = run_battery(
        engine, prompts, plain, options.max_tokens, options.num_speculative_tokens, options.min_acceptance_length, name
    )
    progress.advance(task)
    findings = drafter.pop("findings") + behaviour.pop("findings")
    return StageResult(name, policy, findings, drafter, behaviour)


def repair_findings(repair: dict) -> list[Finding]:
    findings = [
        Finding("repair", "info", f"filled {name} from {key}", stage="repair")
        for name, key in repair["repaired"].items()
    ]
    shard = repair.get("tp_shard")
    if shard:
        ok = shard["matches_table"] and shard["padding_zero"]
        verdict = "matches the table, padding zero" if ok else "WRONG rows or padding"
        findings.append(
            Finding(
                "repair.tp_shard",
                "info" if ok else "error",
                f"TP rank {shard['tp_rank']}/{shard['tp_size']}: rows {shard['rows']} ({shard['real_rows']} real, "
                f"{shard['padded_rows']} padded), {verdict}",
                stage="repair",
            )
        )
    return findings
