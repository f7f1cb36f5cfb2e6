"""One pipeline rank: load the tensors it owns, then run the commands the first rank broadcasts."""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdoctor.checks.drafter_state import inspect_drafter, repair_drafter
from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.comm import PipelineComm
from specdoctor.runtime.decode import GenerateRequest, RankModel, generate, prompt_logits
from specdoctor.runtime.drafter_loading import DrafterPolicy, build_drafter
from specdoctor.runtime.loader import load_target_stage
from specdoctor.runtime.partition import placements

# Commands only the drafter's rank answers, with what the checks need from the live drafter.
DRAFTER_COMMANDS = {"inspect_drafter": inspect_drafter, "repair_drafter": repair_drafter}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineSpec:
    """Everything a rank needs to build itself; sent to each rank process."""

    model: str
    pp: int = 1
    pp_partition: str | None = None
    policy: DrafterPolicy = field(default_factory=DrafterPolicy)
    dtype: str = "float32"
    device: str = "cpu"
    timeout_s: float = 60.0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise SpecdoctorError(f"unknown dtype {self.dtype!r} (choose from {', '.join(DTYPES)})")
        if self.device not in ("cpu", "cuda"):
            raise SpecdoctorError(f"unknown device {self.device!r} (choose cpu or cuda)")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise SpecdoctorError("--device cuda was requested but no CUDA device is available")


def rank_device(spec: EngineSpec, rank: int) -> torch.device:
    if spec.device == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def load_rank(spec: EngineSpec, rank: int, world_size: int) -> tuple[RankModel, dict]:
    """Build this rank's stage (and the drafter on the last rank), reading only the tensors it owns."""
    device = rank_device(spec, rank)
    dtype = DTYPES[spec.dtype]
    checkpoint = Checkpoint(spec.model)
    placement = placements(checkpoint.config, world_size, spec.pp_partition)[rank]
    stage = load_target_stage(checkpoint, placement.layers, placement.has_embedding, placement.has_head, dtype, device)
    drafter, provenance = None, {}
    if placement.has_drafter:
        drafter, sources = build_drafter(checkpoint, stage, world_size, spec.policy, dtype, device)
        provenance = sources.sources
    comm = PipelineComm(rank, world_size, device, spec.timeout_s)
    info = {
        "rank": rank,
        "layers": [placement.layers.start, placement.layers.stop],
        "has_embedding": placement.has_embedding,
        "has_head": placement.has_head,
        "has_drafter": placement.has_drafter,
        "keys_read": sorted(set(checkpoint.keys_read)),
        "bytes_read": checkpoint.bytes_read,
        "drafter_provenance": provenance,
    }
    return RankModel(placement, stage, drafter, comm, checkpoint, provenance), info


class StepReporter:
    """The first rank's per-step callback: the tokens so far when streaming, else a beat at most once a
    second, so the controller's silence deadline catches stalls but not long generations."""

    def __init__(self, reply: Callable[[str, object], None], stream: bool):
        self.reply, self.stream, self.last_beat = reply, stream, time.monotonic()

    def __call__(self, result) -> None:
        if self.stream:
            self.reply("partial", result.tokens)
        elif time.monotonic() - self.last_beat >= 1.0:
            self.reply("alive", None)
            self.last_beat = time.monotonic()


def serve(model: RankModel, next_command: Callable[[], tuple] | None, reply: Callable[[str, object], None]) -> None:
    """Run broadcast commands until 'shutdown'. Only the first rank has `next_command`."""
    while True:
        kind, payload = model.comm.broadcast_command(next_command() if next_command else None)
        if kind == "shutdown":
            return
        if kind == "generate":
            first = model.placement.is_first
            result = generate(model, payload, on_step=StepReporter(reply, payload.stream) if first else None)
            if first:
                reply("result", result)
        elif kind == "score":
            logits = prompt_logits(model, payload)
            if model.placement.is_last:
                reply("logits", logits)
        elif kind in DRAFTER_COMMANDS and model.placement.is_last:
            reply(kind, DRAFTER_COMMANDS[kind](model, **payload))


def keep_freed_memory_mapped() -> None:
    """glibc hands every freed block over 128 KiB back to the kernel and page-faults it in again on
    the next allocation; a decode step makes such blocks dozens of times (gathered expert weights,
    logits), so raise that threshold, as jemalloc or tcmalloc would behave. No-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD


def rank_main(spec: EngineSpec, rank: int, world_size: int, port: int, inbox, replies) -> None:
    """Entry point of a rank process started by `Engine`; `replies` is this rank's own pipe to the controller."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    keep_freed_memory_mapped()
    model = None
    parent = os.getppid()

    def next_command() -> tuple:
        # Idle ranks wait inside a collective; a heartbeat keeps them under its timeout and
        # notices a dead peer even when no request is in flight.
        try:
            return inbox.get(timeout=min(spec.timeout_s / 4, 2.0))
        except queue.Empty:
            # A controller killed without closing the engine leaves no one to send "shutdown".
            return ("shutdown", None) if os.getppid() != parent else ("noop", None)

    try:
        model, info = load_rank(spec, rank, world_size)
        replies.send(("ready", rank, info))
        serve(model, next_command if rank == 0 else None, lambda kind, payload: replies.send((kind, rank, payload)))
    except SpecdoctorError as err:
        replies.send(("error", rank, str(err)))
        raise SystemExit(1) from None
    except Exception as err:  # an unexpected failure: keep the traceback for whoever reads the logs
        replies.send(("error", rank, f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None
    finally:
        if model is not None:
            model.comm.close()
    # A clean shutdown: the process group is gone and every reply was written synchronously, so the
    # interpreter's teardown of torch (over a second per rank on 2 cores) protects nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_under_torchrun(spec: EngineSpec, request: GenerateRequest):
    """Join a group launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0 returns the result."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != spec.pp:
        raise SpecdoctorError(f"torchrun started {world_size} processes but --pp is {spec.pp}")
    model, _ = load_rank(spec, rank, world_size)
    commands = iter([("generate", request), ("shutdown", None)])
    results = []

    def keep_result(kind: str, payload) -> None:
        if kind == "result":  # per-step "partial" messages matter only to a streaming controller
            results.append(payload)

    try:
        serve(model, (lambda: next(commands)) if rank == 0 else None, keep_result)
    finally:
        model.comm.close()
    return results[0] if results else None
