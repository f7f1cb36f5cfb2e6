"""Compiling behind serving: a rank runs each pass eager until a graph for its shapes is ready, so no request (and no
peer waiting on this rank) ever waits for a compile.

A pass no active graph takes is run eager and asks for a graph (`request`); one thread per rank compiles the asks in
order, loading the saved graphs first. Graphs become active only at a step boundary (`swap_ready`), on every TP rank
of a stage together: the ranks of a stage make the same passes, so they ask for the same graphs in the same order (a
job's number is the same on each), and they agree on how many jobs every one of them has finished (an all-reduce of
the smallest count) before each swaps in the graphs of those jobs. Before and after a swap a pass computes the same
function, eager or compiled (fused kernels: the same tokens, but where two of them are within rounding).

A compile that fails, or a module whose layers break the graph, leaves its passes eager with a warning; the thread is a
daemon, so a process that ends stops it mid-compile, and a graph reaches the cache whole or not at all
(`LayerGraphs.save`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdoctor.runtime.compile_status import CompileStatus

# A shape class (`LayerGraphs.shape_key`) asked for again once its graph was swapped in and still did not take a pass (a
# guard the class leaves open): at most this often. An ask that a graph already takes costs the thread a guard check.
ATTEMPTS_PER_SHAPE = 4
# The compile thread yields the CPU to serving: its own and its compilers' processes run at this niceness.
COMPILE_NICENESS = 10


@dataclass(frozen=True)
class JobOutcome:
    loaded: int = 0  # saved graphs loaded
    compiled: int = 0  # graphs compiled
    warning: str | None = None  # why a graph could not be had: its passes stay eager


@dataclass
class Job:
    number: int
    graphs: object  # the LayerGraphs asking
    args: tuple | None  # the pass's inputs (their structure frozen); None: load the saved graphs
    grad: bool  # the pass's grad mode (a graph is traced, and guarded, under it)


class BackgroundCompiler:
    """A rank's compile thread and the graphs it swaps in. `group`: the TP group of the rank's stage (None: alone);
    `report(status)`: called on every change (from either thread)."""

    def __init__(self, rank: int = 0, group=None, device: torch.device | None = None, report: Callable | None = None):
        self.group, self.device, self.report = group, device or torch.device("cpu"), report
        self.status = CompileStatus(rank)
        self.modules: list = []  # every LayerGraphs of the rank
        self.jobs: queue.Queue[Job] = queue.Queue()
        self.agreed = 0  # jobs every TP rank of the stage has finished: their graphs are active
        self.finished_jobs = 0  # written by the thread only
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    # -- the serving thread -------------------------------------------------------------------------------------

    def add(self, graphs) -> None:
        """A module's graphs: its saved ones are loaded first, by the thread."""
        self.modules.append(graphs)
        self._queue(graphs, None)

    def request(self, graphs, args: tuple) -> None:
        """A pass no active graph took: ask for a graph of its shapes, unless one is on its way."""
        key = graphs.shape_key(args)
        number, attempts = graphs.requests.get(key, (None, 0))
        if number is not None and number >= self.agreed:
            return  # queued or compiling, or finished on this rank but not yet on every one of its stage
        if attempts >= ATTEMPTS_PER_SHAPE:
            return
        graphs.requests[key] = (self._queue(graphs, frozen(args)), attempts + 1)

    def swap_ready(self) -> None:
        """At a step boundary, on every TP rank of a stage: swap in the graphs of the jobs each of them finished."""
        if self.agreed == self.status.requested:
            return  # nothing on its way anywhere (the same on every TP rank: they asked alike)
        finished = self.finished_jobs
        if self.group is not None:
            smallest = torch.tensor([finished], device=self.device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=self.group)
            finished = int(smallest)
        if finished > self.agreed:
            self.agreed = finished
            self.status.active = sum(graphs.activate(finished) for graphs in self.modules)
            self._report()

    def wait_idle(self, beat: Callable[[], None] = lambda: None) -> None:
        """Until every job asked so far is finished; `beat()` about once a second meanwhile."""
        last_beat = time.monotonic()
        while self.finished_jobs < self.status.requested:
            time.sleep(0.05)
            if time.monotonic() - last_beat >= 1.0:
                beat()
                last_beat = time.monotonic()

    def report_to(self, report: Callable[[CompileStatus], None]) -> None:
        """From now on, `report(status)` on every change (from either thread); once now."""
        self.report = report
        self._report()

    # -- the compile thread -------------------------------------------------------------------------------------

    def _queue(self, graphs, args: tuple | None) -> int:
        number = self.status.requested
        self.status.requested += 1
        self.jobs.put(Job(number, graphs, args, torch.is_grad_enabled()))
        if self.thread is None:
            make_torchs_lazy_trace()
            self.thread = threading.Thread(target=self._run, name="specdoctor-compile", daemon=True)
            self.thread.start()
        return number

    def _run(self) -> None:
        with contextlib.suppress(OSError):  # this thread alone (Linux: a thread's own niceness), and its compilers
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
        while True:
            job = self.jobs.get()
            started = time.perf_counter()
            self.status.compiling = job.graphs.name if job.args is not None else ""
            self._report()
            outcome = job.graphs.run_job(job)
            with self.lock:
                status = self.status
                status.loaded += outcome.loaded
                status.compiled += outcome.compiled
                status.failed += outcome.warning is not None
                status.seconds += time.perf_counter() - started if outcome.compiled else 0.0
                if outcome.warning:
                    status.warnings.append(outcome.warning)
                status.finished, status.compiling = job.number + 1, ""
                self.finished_jobs = job.number + 1
            self._report()

    def _report(self) -> None:
        if self.report:
            with self.lock:
                snapshot = copy.deepcopy(self.status)
            self.report(snapshot)


def make_torchs_lazy_trace() -> None:
    """Inductor makes one plain torch.fx trace per process, lazily (a placeholder graph its loop bodies share), and a
    plain fx trace patches nn.Module.__call__ for every thread while it runs: a pass the serving thread ran meanwhile
    failed ("module is not installed as a submodule"). Made here, on the serving thread, before the compile thread
    starts (milliseconds: torch.compile has imported Inductor). The tracers Inductor runs per graph (make_fx's) pass
    other threads' module calls through untouched."""
    from torch._inductor.loop_body import InterpreterShim

    InterpreterShim._dummy_gm()


def shape_class(args) -> tuple:
    """What decides which graph a pass needs, roughly, as Dynamo sizes a trace: each tensor's dtype and sizes (0 and 1
    as they are; any other size by which of the distinct sizes seen it is, since a graph takes any size of 2 or more
    but assumes two sizes that were equal when traced stay equal), the constants passed, and the other inputs' types
    and the tensors they hold (a cache's planned mask carries the pass's span), not their numbers (a cache's length:
    its buffers' sizes say what a graph reads of it)."""
    sizes: dict[int, str] = {}
    seen: set[int] = set()

    def size(n: int) -> int | str:
        return n if n < 2 else sizes.setdefault(n, f"s{len(sizes)}")

    def walk(value, constants: bool):
        if isinstance(value, torch.Tensor):
            return str(value.dtype), tuple(size(n) for n in value.shape)
        if isinstance(value, (tuple, list)):
            return tuple(walk(item, constants) for item in value)
        if isinstance(value, dict):
            return tuple((key, walk(item, constants)) for key, item in value.items())
        if value is None or isinstance(value, (bool, int, float, str)):
            return value if constants else type(value).__name__
        if hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module) and id(value) not in seen:
            seen.add(id(value))
            return type(value).__qualname__, walk(vars(value), constants=False)
        return type(value).__qualname__

    return walk(args, constants=True)


def frozen(value, memo: dict | None = None):
    """`value` with its containers and objects copied (their tensors not): what a pass's inputs were when it ran, for
    the compile thread to trace while the serving thread moves on (a cache plans its next pass into the same object).
    Tracing reads the tensors' shapes, never their data."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, (tuple, list)):
        copied = type(value)(frozen(item, memo) for item in value)
    elif isinstance(value, dict):
        copied = {key: frozen(item, memo) for key, item in value.items()}
    elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
        copied = copy.copy(value)
        memo[id(value)] = copied
        copied.__dict__.update({name: frozen(item, memo) for name, item in vars(value).items()})
    else:
        copied = value
    memo[id(value)] = copied
    return copied
