"""A vLLM worker as specdoctor examines it: its place in the TP x PP grid, the drafter module vLLM built and its
vocabulary-split tables, the checkpoints vLLM loaded them from. Run inside the worker, after `load_model`."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path

import torch

from specdoctor.engines.vllm import SUPPORTED_VERSIONS
from specdoctor.engines.worker_check import LiveTable, WorkerPlace, examine_tables, repair_tables, still_broken

LOG = logging.getLogger("vllm.specdoctor")  # under vLLM's own logger, so its handler prints it
FAULTS = ("embedding-zeroed", "embedding-uninitialised", "vocab-shard-shifted", "head-target-over-pruned-vocab")


def worker_place() -> WorkerPlace:
    from vllm.distributed import parallel_state

    tp, pp = parallel_state.get_tp_group(), parallel_state.get_pp_group()
    return WorkerPlace(tp.rank_in_group, tp.world_size, pp.rank_in_group, pp.world_size)


def drafter_tables(draft: torch.nn.Module, kind) -> dict[str, torch.nn.Module]:
    """The drafter's vocabulary-split modules by the name its kind gives their weights (`DrafterKind.engine_name`);
    a module reached by two paths, as MTP's head is, is named once."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    tables, seen = {}, set()
    for path, module in draft.named_modules(remove_duplicate=False):
        if isinstance(module, VocabParallelEmbedding) and id(module) not in seen:
            seen.add(id(module))
            tables[kind.engine_name(f"{path}.weight")] = module
    return tables


def make_fault(draft: torch.nn.Module, target: torch.nn.Module, fault: str, place: WorkerPlace) -> None:
    """A failure engines have shipped, made in the live drafter: its embedding module re-homed (never written
    through a module it shares with the target), then left zeroed, as allocated, or (TP rank 1 only) holding the
    rows of the shard one row off; or its head over a pruned draft vocabulary replaced by the target's."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r} (choose from {', '.join(FAULTS)})")
    if fault == "vocab-shard-shifted" and place.tp_rank != 1:
        return
    if fault == "head-target-over-pruned-vocab":
        if draft.lm_head.org_vocab_size >= target.lm_head.org_vocab_size:
            raise ValueError(f"{fault} needs a drafter whose draft vocabulary is pruned")
        draft.lm_head = target.lm_head
        return
    shared = draft.model.embed_tokens
    own = copy.copy(shared)  # its settings (shard indices, quant method), with registries of its own:
    own._parameters, own._buffers, own._modules = dict(shared._parameters), dict(shared._buffers), dict(shared._modules)
    weight = shared.weight.detach()
    made = {
        "embedding-zeroed": torch.zeros_like,
        "embedding-uninitialised": torch.empty_like,
        "vocab-shard-shifted": lambda rows: torch.roll(rows, 1, dims=0),
    }[fault](weight)
    own.weight = torch.nn.Parameter(made.clone(), requires_grad=False)
    draft.model.embed_tokens = own


class UnrepairableDrafter(RuntimeError):
    """Tables a repair could not set right: the worker stops, so the deployment does not come up."""


def examine_worker(worker, repair: bool) -> dict:
    """This worker's report: its place, and per drafter table whether it holds its checkpoint rows; with `repair`,
    what was read into the tables found wrong and the examination after."""
    import vllm

    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import drafter_kind

    place = worker_place()
    report = {"worker": vars(place) | {"label": place.label()}, "vllm": vllm.__version__, "tables": []}
    if not vllm.__version__.startswith(SUPPORTED_VERSIONS):
        supported = ", ".join(SUPPORTED_VERSIONS)
        return report | {"error": f"vLLM {vllm.__version__} is not supported (supported: {supported})"}
    draft = worker.get_draft_model()
    report["has_drafter"] = draft is not None
    if draft is None:  # a rank before the last: vLLM builds the drafter on the last PP rank only
        return report
    config = worker.vllm_config
    target_path, speculative = config.model_config.model, config.speculative_config
    own_path = speculative.model if speculative.model != target_path else None
    kind = drafter_kind(Checkpoint(target_path), target_path, own_path, speculative.method)
    target_storage = {p.untyped_storage().data_ptr() for p in worker.get_model().parameters()}
    tables = [
        LiveTable(name, module.weight, module.weight.untyped_storage().data_ptr() in target_storage)
        for name, module in drafter_tables(draft, kind).items()
    ]
    report["kind"] = kind.name
    report["tables"] = examine_tables(kind, place, tables)
    if repair:
        report["repair"] = repair_tables(kind, place, tables, report["tables"])
        report["after"] = examine_tables(kind, place, tables)
    return report


def report_worker(worker, directory: str, repair: bool) -> dict:
    """Examine (and with `repair` repair) this worker and write its report, whatever happens (a worker that wrote
    none is never called healthy); in repair mode, stop the worker where a table is still wrong after the repair."""
    try:
        report = examine_worker(worker, repair)
    except Exception as err:  # the report says what stopped it
        place = worker_place()
        report = {"worker": vars(place) | {"label": place.label()}, "error": f"{type(err).__name__}: {err}"}
    place = report["worker"]
    path = Path(directory) / f"tp{place['tp_rank']}-pp{place['pp_rank']}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(report, indent=2))
    os.replace(partial, path)  # whole or absent: a reader never sees half a report
    return report


def load_and_report(worker, directory: str, repair: bool, fault: str | None) -> None:
    """After vLLM's own loading: the tests' fault, if any, then the worker's report; in repair mode a worker whose
    drafter is still wrong stops, so the deployment does not come up."""
    draft = worker.get_draft_model()
    if fault and draft is not None:
        make_fault(draft, worker.get_model(), fault, worker_place())
    report = report_worker(worker, directory, repair)
    place = report["worker"]
    where = f"TP {place['tp_rank']}, PP {place['pp_rank']}"
    for name, key in report.get("repair", {}).get("repaired", {}).items():
        LOG.warning("specdoctor: worker %s: repaired %s from the checkpoint's %s", where, name, key)
    broken = still_broken(report) if repair else []
    if broken:
        raise UnrepairableDrafter(f"specdoctor: worker {where}: " + "; ".join(broken))
