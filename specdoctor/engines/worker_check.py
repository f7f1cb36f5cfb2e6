"""One engine worker's drafter tables (token embeddings and heads, vocabulary-split as the engines split them)
against the checkpoint rows its slice must hold: the same rule (`DrafterKind.expected_source`) and the same shard
check (zero padding rows included) as the runtime's repair."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdoctor.runtime.drafter.kind import DrafterKind
from specdoctor.runtime.drafter.repair import check_vocab_shard, read_vocab_shard
from specdoctor.runtime.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class WorkerPlace:
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int

    def label(self) -> str:
        return f"TP {self.tp_rank}/{self.tp_size}, PP {self.pp_rank}/{self.pp_size}"


@dataclass(frozen=True)
class LiveTable:
    name: str  # as the runtime's drafter kind names the tensor (embed_tokens.weight, lm_head.weight, ...)
    tensor: torch.Tensor  # this worker's slice, its padding rows included
    shared_with_target: bool  # the very storage of one of the target's tensors (vLLM shares them by design)


def examine_tables(kind: DrafterKind, place: WorkerPlace, tables: list[LiveTable]) -> list[dict]:
    """Per table: the checkpoint key it must hold, and whether this worker's rows hold it and its padding is zero."""
    tp = TensorParallel(place.tp_rank, place.tp_size)
    found = []
    for table in tables:
        source = kind.expected_source(table.name)
        record = {"tensor": table.name, "shared_with_target": table.shared_with_target}
        if source is None:
            found.append({**record, "key": None, "ok": False, "problem": "no checkpoint tensor is expected there"})
            continue
        checkpoint, key = source
        shard = check_vocab_shard(checkpoint, key, table.tensor, tp)
        problem = None
        if not shard.matches_table:
            problem = f"rows {shard.rows[0]}..{shard.rows[1]} do not hold {key}'s rows"
        elif not shard.padding_zero:
            problem = f"its {shard.padded_rows} padding rows are not zero"
        if problem and table.shared_with_target:
            problem += "; it is the target's own tensor, which a repair in place would change"
        found.append({**record, "key": key, "rows": shard.rows, "ok": shard.ok, "problem": problem})
    return found


def repair_tables(kind: DrafterKind, place: WorkerPlace, tables: list[LiveTable], examined: list[dict]) -> dict:
    """Copy the checkpoint's rows for this worker's slice into each table the examination found wrong, in place
    (the checkpoint-index loader reads this slice alone). A table that is the target's own tensor is not written
    (that would change the target): the examination after names it as still wrong."""
    repaired, start = {}, time.perf_counter()
    before = sum(checkpoint.bytes_read for checkpoint in kind.checkpoints)
    for table, record in zip(tables, examined, strict=True):
        if record["ok"] or record["key"] is None or table.shared_with_target:
            continue
        checkpoint, key = kind.expected_source(table.name)
        rows = read_vocab_shard(checkpoint, key, place.tp_size, place.tp_rank)
        with torch.no_grad():
            table.tensor.copy_(rows.to(table.tensor.dtype))
        repaired[table.name] = key
    bytes_read = sum(checkpoint.bytes_read for checkpoint in kind.checkpoints) - before
    return {"repaired": repaired, "bytes_read": bytes_read, "seconds": time.perf_counter() - start}


def still_broken(report: dict) -> list[str]:
    """One line per table of a worker's report a repair left wrong (or the error that stopped its examination)."""
    if "error" in report:
        return [report["error"]]
    return [f"{record['tensor']}: {record['problem']}" for record in report.get("after", []) if not record["ok"]]
