"""One pipeline rank: load the tensors it owns, then run the commands the first rank broadcasts."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

from specdoctor.errors import PipelineError, SpecdoctorError
from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.background_compile import BackgroundCompiler
from specdoctor.runtime.cache.prefix import PrefixStore
from specdoctor.runtime.checkpoint.loader import load_target_stage
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.comm import PipelineComm
from specdoctor.runtime.compile import compile_layers, measured_once
from specdoctor.runtime.decode.batch import decode_batch
from specdoctor.runtime.decode.continuous import run_continuous
from specdoctor.runtime.decode.pipeline import RankModel, prompt_logits
from specdoctor.runtime.decode.requests import GenerateRequest
from specdoctor.runtime.drafter.kind import DrafterKind
from specdoctor.runtime.drafter.measure import combine_states, measure_drafter
from specdoctor.runtime.drafter.policy import Provenance
from specdoctor.runtime.drafter.registry import open_drafter
from specdoctor.runtime.drafter.repair import combine_repairs, repair_drafter
from specdoctor.runtime.drafter.taps import tap_route
from specdoctor.runtime.faults import Faults
from specdoctor.runtime.heap import freeze_survivors, frozen_startup_heap
from specdoctor.runtime.launch import kill_descendants
from specdoctor.runtime.models.moe import MoE, measure_grouped_from
from specdoctor.runtime.options import Device, QuantizedWeights, RuntimeOptions, StateRollback
from specdoctor.runtime.partition import placements
from specdoctor.runtime.refusals import runtime_refusal
from specdoctor.runtime.tap_probe import probe_taps

# Operations only the drafter's stage answers: what the live drafter holds, and its repair; each TP rank's
# answer about its shard, combined into one.
DRAFTER_OPERATIONS = {
    "measure_drafter": (measure_drafter, combine_states),
    "repair_drafter": (repair_drafter, combine_repairs),
}


def rank_device(options: RuntimeOptions, rank: int) -> torch.device:
    if options.device == Device.CPU:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SpecdoctorError("--device cuda was requested but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def load_rank(options: RuntimeOptions, rank: int) -> tuple[RankModel, dict]:
    """Join the process group (which sets this rank's tensor-parallel group), then build this rank's shard of
    its stage (and of the drafter on the last stage)."""
    comm = PipelineComm(rank, options.pp, options.tp, rank_device(options, rank), options.timeout)
    torch.manual_seed(comm.shared_seed())  # unseeded sampling draws alike on the TP ranks of the last stage
    if comm.device.type == "cuda":
        # SDPA's cuDNN backend (its pick for bf16 on Hopper) plans each new key length, and decoding grows it every
        # step: 15 ms of host time per attention call on an H200 (profiled). Flash and memory-efficient attention take
        # any length.
        torch.backends.cuda.enable_cudnn_sdp(False)
    with comm.working("loading its shard"):
        model, info = build_rank(options, rank)
    model.comm = comm
    # A peer still loading (a larger stage, a slower disk) is waited for here, not timed out at the first command.
    comm.wait_for_peers("to finish loading")
    return model, info


def build_rank(
    options: RuntimeOptions, rank: int, checkpoint: Checkpoint | None = None, kind: DrafterKind | None = None
) -> tuple[RankModel, dict]:
    """Global rank `rank`'s shard of its stage (and of the drafter on the last stage), reading only the tensors and
    rows it owns; not yet connected to its peers (`comm` is None), so one rank of a pipeline can be built alone
    (the tests, and a model larger than the machine). `checkpoint` and `kind`: already opened by the caller."""
    device, dtype = rank_device(options, rank), options.dtype.torch()
    stage_rank, tp_rank = divmod(rank, options.tp)
    if tensor_parallel.current().group is None:  # built alone: the shapes of its TP rank, no group
        tensor_parallel.use(tensor_parallel.TensorParallel(tp_rank, options.tp))
    checkpoint = checkpoint or Checkpoint(options.model)
    checkpoint.require_runnable()  # also under torchrun, where no Engine checked first
    if kind is None:
        kind = open_drafter(checkpoint, options)
    else:
        kind.require_runnable()
    ranks = placements(checkpoint.config, options.pp, options.pp_partition, has_drafter=kind is not None)
    placement = ranks[stage_rank]
    packed = options.quantized_weights == QuantizedWeights.PACKED
    stage = load_target_stage(
        checkpoint, placement.layers, placement.has_embedding, placement.has_head, dtype, device, packed
    )
    route = None
    if kind and kind.taps:  # the taps this rank captures and moves on (runtime/drafter/taps.py)
        route = tap_route(
            kind.engine_taps(options.tap_policy), options.tap_policy, placement, [r.layers for r in ranks]
        )
        stage.tap_entries = route.own
    drafter, provenance = None, Provenance()
    if placement.has_drafter:
        drafter, provenance = kind.build(stage, options, device)
    modules = (stage, drafter) if drafter is not None else (stage,)
    moe_layers = [layer for module in modules for layer in module.modules() if isinstance(layer, MoE)]
    grouped_from = choose_moe_paths(moe_layers, device)
    graphs = None
    if options.compile:
        graphs = BackgroundCompiler(rank, tensor_parallel.current().group, device)
        for module in modules:
            compile_layers(module, graphs)
    info = {
        "rank": stage_rank,
        "tp_rank": tp_rank,
        "layers": [placement.layers.start, placement.layers.stop],
        "has_embedding": placement.has_embedding,
        "has_head": placement.has_head,
        "has_drafter": placement.has_drafter,
        "keys_read": sorted(set(checkpoint.keys_read)),
        "bytes_read": checkpoint.bytes_read,
        "drafter_provenance": provenance.labels(),
        # where the MoE layers switch paths: serve's compile warm-up crosses it (runtime/compile.py)
        "gathered_token_limit": max((layer.gathered_token_limit() for layer in moe_layers), default=0),
        "grouped_from": grouped_from,
    }
    rollback = options.state_rollback == StateRollback.EXACT
    faults = Faults.parse(options.fault).gated(kind.dummy_drafts_past(options) if kind else None)
    model = RankModel(
        placement, stage, drafter, None, device, dtype, checkpoint, provenance, rollback, route, kind, faults
    )
    model.graphs = graphs
    config = checkpoint.config
    hybrid = any(map(config.is_linear_attention, range(config.num_hidden_layers)))
    if options.enable_prefix_caching and not hybrid:  # recurrent states are not kept per block
        model.prefix_store = PrefixStore()
    return model, info


def choose_moe_paths(layers: list[MoE], device: torch.device) -> dict[str, int | None]:
    """On the CPU, from how many tokens each MoE layer runs its experts as a grouped GEMM, timed once per expert
    shape on this rank's threads (runtime/models/moe.py) and kept in the compile cache for later starts;
    {expert shape: tokens, or None for never}."""
    measured: dict[str, int | None] = {}
    if device.type != "cpu":  # torch's grouped GEMM on CUDA takes bfloat16 on recent GPUs only: not timed there
        return measured
    for layer in layers:
        if layer.packed:
            continue
        shape = "x".join(map(str, layer.gate_up.shape)) + f" {layer.gate_up.dtype}"
        if shape not in measured:
            measured[shape] = measured_once(grouped_from_key(shape), functools.partial(measure_grouped_from, layer))
        layer.grouped_from = measured[shape]
    return measured


def grouped_from_key(shape: str) -> str:
    """Where the compile cache keeps the measured crossover of experts of `shape` on this rank's threads."""
    return f"grouped GEMM from, {torch.get_num_threads()} thread(s), experts {shape}"


def fewest_grouped_tokens(rank_info: list[dict]) -> int | None:
    """The fewest tokens from which any of these ranks' MoE layers run the grouped GEMM (None: none do)."""
    measured = [tokens for info in rank_info for tokens in info["grouped_from"].values() if tokens]
    return min(measured, default=None)


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


def serve(
    model: RankModel,
    next_command: Callable[[], tuple] | None,
    reply: Callable[[str, object], None],
    poll: Callable[[bool], list[tuple]] | None = None,
) -> None:
    """Run broadcast commands until 'shutdown'. Only the first rank has `next_command` and, for continuous
    batching, `poll` (see runtime/decode/continuous.py). TP rank 0 of a stage speaks for it: the others compute
    alike and stay silent, but for the drafter's operations, whose answers differ per shard."""
    speaks = model.comm.tp_rank == 0
    first, last = model.placement.is_first and speaks, model.placement.is_last and speaks
    # The loaded model, then what each command kept (the first ones compile the graphs): no full collection walks
    # them in the middle of a step or a timed run.
    with frozen_startup_heap():
        while True:
            kind, payload = model.comm.broadcast_command(next_command() if next_command else None)
            if kind == "shutdown":
                return
            if kind == "continuous":  # serves until shutdown
                report = (lambda news: reply("updates", news)) if last else None
                run_continuous(model, *payload, poll, report)
                return
            run_command(model, kind, payload, reply, first, last)
            # After the reply, so the rank's own times leave it out; a controller's next command waits for it,
            # but it walks only what this command kept, not the frozen heap.
            freeze_survivors()


def run_command(model: RankModel, kind: str, payload, reply: Callable[[str, object], None], first: bool, last: bool):
    """One command of `serve`'s loop, in a function of its own: its results are gone when the loop freezes what
    survived it."""
    if kind == "generate":
        result = decode_batch(model, payload, on_step=StepReporter(reply, payload.stream) if first else None)
        if first:
            reply("result", result)
    elif kind == "score":
        logits = prompt_logits(model, payload)
        if last:
            reply("logits", logits)
    elif kind == "probe_taps":  # every rank takes part; the drafter's rank answers
        readings = probe_taps(model, payload)
        if last:
            reply(kind, readings)
    elif kind == "finish_compiles":
        model.finish_compiles(beat=lambda: reply("alive", None))
        if first:
            reply(kind, None)
    elif kind in DRAFTER_OPERATIONS and model.placement.is_last:
        operation, combine = DRAFTER_OPERATIONS[kind]
        answers = model.comm.gather_tp(operation(model, **payload), kind)
        if last:
            reply(kind, combine(answers))


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


class ControllerGone(Exception):
    """The controller's end of this rank's reply pipe is closed: it was stopped."""


def no_shared_progress_lock() -> None:
    """Inductor's compile shows tqdm bars, and tqdm makes a cross-process lock for them on first use: a rank that
    ends without Python's exit handlers (os._exit below, or stopped by a signal) leaves that lock behind and the
    controller's resource tracker warns of a leak at exit. A rank's bars share no lock with other processes."""
    try:
        from tqdm.std import TqdmDefaultWriteLock
    except ImportError:
        return
    TqdmDefaultWriteLock.mp_lock = None


def rank_threads(ranks: int, host_cores: int) -> int:
    """Each rank's intra-op threads: the machine's cores, less `host_cores` left to the controller's own work
    (`serve`'s HTTP front; vLLM's CPU backend keeps one per worker for its scheduler), shared by the ranks."""
    return max(1, ((os.cpu_count() or 1) - host_cores) // ranks)


def rank_main(
    options: RuntimeOptions, rank: int, port: int, inbox, replies, environment: dict[str, str], host_cores: int
) -> None:
    """Entry point of a rank process started by `Engine`; `replies` is this rank's own pipe to the controller.
    `environment`: the controller's, as it was when the engine started (the fork server's is older)."""
    # Ctrl-C reaches every process of the terminal's group: the controller stops the ranks, so a rank
    # interrupted on its own would only print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(rank_threads(options.pp * options.tp, host_cores))
    keep_freed_memory_mapped()
    no_shared_progress_lock()
    model = None
    parent = os.getppid()

    def next_command(timeout: float = min(options.timeout / 4, 2.0)) -> tuple:
        # Idle ranks wait inside a collective; a heartbeat keeps them under its timeout and
        # notices a dead peer even when no request is in flight.
        try:
            return inbox.get(timeout=timeout)
        except queue.Empty:
            # A controller killed without closing the engine leaves no one to send "shutdown".
            return ("shutdown", None) if os.getppid() != parent else ("noop", None)

    def poll(idle: bool) -> list[tuple]:
        """What the controller queued since the last step; an idle batch waits (briefly) for something."""
        messages = [next_command(0.5)] if idle else []
        while True:
            try:
                messages.append(inbox.get_nowait())
            except queue.Empty:
                return [message for message in messages if message[0] != "noop"]

    sending = threading.Lock()  # the compile thread reports on the same pipe

    def reply(kind: str, payload) -> None:
        try:
            with sending:
                replies.send((kind, rank, payload))
        except (BrokenPipeError, ConnectionResetError):  # the controller stopped while this rank worked
            raise ControllerGone from None

    def report(kind: str, payload) -> None:
        with contextlib.suppress(ControllerGone):  # no one left to tell
            reply(kind, payload)

    try:
        model, info = load_rank(options, rank)
        reply("ready", {**info, "threads": torch.get_num_threads()})
        if model.graphs is not None:
            model.graphs.report_to(lambda status: report("compile", status))
        first = rank == 0
        serve(model, next_command if first else None, reply, poll if first else None)
    except ControllerGone:  # stopped by a signal (the controller ends at once): nothing to say
        raise SystemExit(1) from None
    except PipelineError as err:  # a peer failed or hung: the peer's own report names the cause
        report("peer_error", str(err))
        raise SystemExit(1) from None
    except SpecdoctorError as err:
        report("error", str(err))
        raise SystemExit(1) from None
    except Exception as err:  # an unexpected failure: keep the traceback for whoever reads the logs
        report("error", f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise SystemExit(1) from None
    finally:
        kill_descendants(os.getpid())  # a compile behind the passes ends with the rank: its compilers too
        if model is not None:
            model.comm.close()
    # A clean shutdown: the process group is gone and every reply was written synchronously, so the
    # interpreter's teardown of torch (over a second per rank on 2 cores) protects nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
