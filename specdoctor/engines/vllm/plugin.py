"""Loaded by vLLM in every process (`load_general_plugins`), workers included, before the worker is built: wraps
`Worker.load_model` (the CPU and GPU workers share it, and it returns with the target and the drafter loaded) so
the worker examines its drafter right after, and gives the worker `specdoctor_repair` for `collective_rpc`.
Nothing happens unless specdoctor set REPORTS."""

from __future__ import annotations

import functools
import os

from specdoctor.engines.vllm import FAULT, REPAIR, REPORTS


def register() -> None:
    if not os.environ.get(REPORTS):
        return
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.load_model, "specdoctor", False):  # vLLM may load plugins more than once in a process
        return
    original = Worker.load_model

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not os.environ.get(REPORTS):  # a later start in this process, with the plugin off (check's reference)
            return
        from specdoctor.engines.vllm.worker import load_and_report

        load_and_report(self, os.environ[REPORTS], os.environ.get(REPAIR) == "1", os.environ.get(FAULT))

    load_model.specdoctor = True
    Worker.load_model = load_model
    Worker.specdoctor_repair = repair_now


def repair_now(worker) -> dict:
    """`collective_rpc("specdoctor_repair")`: repair this worker's drafter tables in place, now; its report."""
    from specdoctor.engines.vllm.worker import report_worker

    return report_worker(worker, os.environ[REPORTS], repair=True)
