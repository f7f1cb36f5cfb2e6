"""`generate` under torchrun: each process torchrun started is one rank, and rank 0 returns the result."""

from __future__ import annotations

import os

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.decode.requests import GenerateRequest
from specdoctor.runtime.drafter.registry import open_drafter
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.protocol import Command, Order, Reply
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.runtime.refusals import runtime_refusal
from specdoctor.runtime.worker import serve


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_under_torchrun(options: RuntimeOptions, request: GenerateRequest):
    """Join a group launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 returns the result."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != options.pp * options.tp:
        raise SpecdoctorError(
            f"torchrun started {world_size} processes but --tp {options.tp} x --pp {options.pp} needs "
            f"{options.pp * options.tp}"
        )
    checkpoint = Checkpoint(options.model)  # no Engine checked first: what vLLM refuses, before joining the group
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # torchrun's: the ranks on this machine
    refused = runtime_refusal(checkpoint, open_drafter(checkpoint, options), options, local_ranks)
    if refused:
        raise SpecdoctorError(refused)
    model, _ = load_rank(options, rank)
    orders = iter([Order(Command.GENERATE, request), Order(Command.SHUTDOWN)])
    results = []

    def keep_result(reply: Reply, payload) -> None:
        if reply == Reply.RESULT:  # per-step PARTIAL replies matter only to a streaming controller
            results.append(payload)

    try:
        serve(model, (lambda: next(orders)) if rank == 0 else None, keep_result)
    finally:
        model.comm.close()
    return results[0] if results else None
