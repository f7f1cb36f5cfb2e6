"""A model larger than the machine: the loaded-drafter examination on the drafter's rank alone, in this process.

The rank is built as its engine builds it, but every tensor it loads straight from a checkpoint is a
copy-on-write map of its shard (no copy in memory: the content check reads the sampled rows it compares, and
the full statistics of the few tensors that get them); what a loading policy leaves unloaded, and what a
repair reads, is real memory. Nothing runs through the pipeline, so neither the tap probe nor the battery
runs, and the report says so: such a run is never called healthy (runtime.skipped, exit 1).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from specdoctor.report import CheckReport, StageResult
from specdoctor.runtime.memory import MemoryPlan
from specdoctor.runtime.options import Dtype
from specdoctor.workflow.drafter import (
    BrokenTensors,
    CheckClock,
    DrafterExam,
    exam_of,
    record_examination,
    record_repair,
    skipped,
)
from specdoctor.workflow.examine_and_repair import examine_and_repair

NOT_RUN = {"battery": "not run", "lossless": [], "metrics": None, "proposals": None}
FLOAT_DTYPES = {"F32": Dtype.FLOAT32, "BF16": Dtype.BFLOAT16, "F16": Dtype.FLOAT16}


def stored_dtype(drafter, fallback: Dtype) -> Dtype:
    """The dtype most of the drafter's tensors are stored in, so that they map without a conversion."""
    stored = Counter(info.dtype for source in drafter.checkpoints for info in source.stored.values())
    floats = [code for code, _ in stored.most_common() if code in FLOAT_DTYPES]
    return FLOAT_DTYPES[floats[0]] if floats else fallback


def run_drafter_rank_alone(report: CheckReport, options, checkpoint, drafter, plan: MemoryPlan) -> None:
    """The before examination (and with --repair the repair and the after one), without the behaviour stage."""
    from specdoctor.runtime.drafter.measure import measure_drafter
    from specdoctor.runtime.drafter.repair import repair_drafter
    from specdoctor.runtime.rank_loading import build_rank

    runtime = options.runtime
    runtime = dataclasses.replace(runtime, tp=1, dtype=stored_dtype(drafter, runtime.dtype))
    for source in drafter.checkpoints:
        source.map_weights = True
    clock = CheckClock(report.timings)
    model, _ = build_rank(runtime, runtime.pp - 1, checkpoint, drafter)
    clock.lap("build_drafter_rank")
    not_run = [("the behaviour stage (the battery)", f"it needs the whole model in memory: {plan.shortfall()}")]
    if drafter.taps:
        not_run.append(("the tap probe", "it needs the whole pipeline running"))
    if options.runtime.tp > 1:  # each TP rank's own slice is not built: a fault of one rank's slice goes unseen
        not_run.append(("the per-TP-rank measurement", "the drafter's stage was built alone, at TP 1"))

    def examine(examination: str) -> DrafterExam:
        exam = exam_of(measure_drafter(model), examination)
        findings = exam.findings + [skipped(what, why, examination) for what, why in not_run]
        policy = str(runtime.drafter_policy) if examination == "before" else "repaired"
        record_examination(report, clock, StageResult(examination, policy, findings, exam.record, dict(NOT_RUN)))
        return exam

    def repair(broken: BrokenTensors):
        return record_repair(report, clock, repair_drafter(model, broken))

    examine_and_repair(examine, repair if options.repair else None)
