"""The controller: starts one process per pipeline rank and hands them requests.

with Engine(RuntimeOptions("demo", pp=4, num_speculative_tokens=3, drafter_policy="engine-legacy")) as engine:
    result = engine.generate([[1, 2, 3]], max_new_tokens=32)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for_any

import torch
from rich.console import Console
from rich.progress import Progress

from specdoctor.errors import PipelineError, SpecdoctorError
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import model_eos_token_ids
from specdoctor.runtime.compile_status import CompileStatus
from specdoctor.runtime.decode.continuous import CANCEL, JOIN, RowUpdate
from specdoctor.runtime.decode.requests import (
    GenerateRequest,
    GenerateResult,
    SequenceRequest,
    validate_request,
    validate_sequences,
    validate_speculative_tokens,
)
from specdoctor.runtime.drafter.measure import DrafterState
from specdoctor.runtime.drafter.registry import open_drafter, speculative_tokens
from specdoctor.runtime.drafter.repair import RepairResult
from specdoctor.runtime.launch import free_port, kill_descendants, process_state, rank_context, stop_signals_held
from specdoctor.runtime.options import DraftSampleMethod, RuntimeOptions
from specdoctor.runtime.partition import placements
from specdoctor.runtime.refusals import runtime_refusal
from specdoctor.runtime.sampling import SamplingParams
from specdoctor.runtime.tap_probe import TapReading
from specdoctor.runtime.worker import fewest_grouped_tokens, rank_main

# What a failing rank reports: its own failure, or a failure talking to a peer (a consequence).
ERRORS = ("error", "peer_error")


class Engine:
    def __init__(
        self,
        options: RuntimeOptions,
        checkpoint: Checkpoint | None = None,
        show_progress: bool = False,
        host_cores: int = 0,
    ):
        """Start the ranks; pass `checkpoint` when the caller has already opened it (no second header scan), and
        `host_cores`: the cores the ranks leave to this process's own work (their threads take the rest)."""
        # Validate in this process first, so bad input fails before any rank starts.
        self.checkpoint = checkpoint or Checkpoint(options.model)
        self.checkpoint.require_runnable()
        self.config = self.checkpoint.config
        self.drafter = open_drafter(self.checkpoint, options)
        refused = runtime_refusal(self.checkpoint, self.drafter, options)
        if refused:
            raise SpecdoctorError(refused)
        if self.drafter and self.drafter.taps:
            self.drafter.engine_taps(options.tap_policy)
        self.speculates = self.drafter is not None
        self.placements = placements(self.config, options.pp, options.pp_partition, has_drafter=self.speculates)
        # Ranks open the resolved directories ("demo" and Hugging Face ids resolved once, here).
        drafter_path = self.drafter.path if self.drafter else None
        self.options = dataclasses.replace(
            options,
            model=str(self.checkpoint.path),
            speculative_model=str(drafter_path) if drafter_path else None,
            num_speculative_tokens=speculative_tokens(self.drafter, options.num_speculative_tokens),
        )
        self.eos_token_ids = model_eos_token_ids(self.checkpoint.path, self.config.eos_token_ids, options.tokenizer)
        # A rank that stops (SIGSTOP, a debugger) between gloo calls is only noticed by its peers'
        # timeouts; the controller's own deadline covers a whole pipeline that falls silent.
        self.silence_limit_s = 2 * options.timeout + 5
        context = rank_context()
        self._inbox = context.Queue()
        # One reply pipe per rank: a shared queue has a cross-process lock, and a rank stopped while
        # holding it would block every other rank's replies, error reports included.
        world = options.pp * options.tp  # TP ranks inner, pipeline stages outer (runtime/comm.py)
        pipes = [context.Pipe(duplex=False) for _ in range(world)]
        self._replies = [reader for reader, _ in pipes]
        port = free_port()
        self._processes = [
            context.Process(
                target=rank_main,
                args=(
                    self.options,
                    rank,
                    port,
                    self._inbox if rank == 0 else None,
                    writer,
                    dict(os.environ),
                    host_cores,
                ),
                name=f"specdoctor-rank-{rank}",
                daemon=True,
            )
            for rank, (_, writer) in enumerate(pipes)
        ]
        self._closed = False
        self.continuous_k = 0  # the speculative tokens of continuous batching, once started
        self.rank_info: list[dict] = [{} for _ in range(world)]
        # --compile: each rank's graphs as it last reported them, and who is told of every report (whichever thread
        # reads the ranks' replies calls it)
        self.compile_status: dict[int, CompileStatus] = {}
        self.on_compile_status: Callable[[dict[int, CompileStatus]], None] | None = None
        try:
            with stop_signals_held():
                for process in self._processes:
                    process.start()
            for _, writer in pipes:
                writer.close()  # only the rank holds its write end now, so its exit reads as end-of-file
            self._wait_until_ready(show_progress)
        except BaseException:
            self.close(grace_s=0)  # ranks still loading would only read "shutdown" once loaded
            raise

    @property
    def rank_pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    @property
    def drafter_provenance(self) -> dict[str, str]:
        return self.rank_info[(self.options.pp - 1) * self.options.tp].get("drafter_provenance", {})

    @property
    def gathered_token_limit(self) -> int:
        """The most tokens a pass of any rank's MoE layers gathers experts for (0: none do)."""
        return max(info["gathered_token_limit"] for info in self.rank_info)

    @property
    def grouped_from(self) -> int | None:
        """The fewest tokens from which a rank's MoE layers run the grouped GEMM (None: none do)."""
        return fewest_grouped_tokens(self.rank_info)

    def _wait_until_ready(self, show_progress: bool) -> None:
        with Progress(console=Console(stderr=True), disable=not show_progress, transient=True) as progress:
            task = progress.add_task(f"starting {len(self._processes)} rank(s)", total=len(self._processes))
            for _ in self._processes:
                # Loading has no deadline (a large checkpoint can take minutes); a dead rank still ends the wait.
                _, rank, info = self._wait_for("ready", None)
                self.rank_info[rank] = info
                progress.advance(task)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int] = 64,
        sampling: SamplingParams = SamplingParams(),
        num_speculative_tokens: int | None = None,
        on_tokens=None,
        every_step_kind: bool = False,
    ) -> GenerateResult:
        """Generate for a batch; `on_tokens(tokens per prompt so far)` is called after every step. `every_step_kind`:
        serve's warm-up (GenerateRequest)."""
        if self._closed:
            raise PipelineError("the engine is closed")
        k = self.options.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        request = GenerateRequest(
            prompts,
            max_new_tokens,
            sampling,
            k,
            self.eos_token_ids,
            stream=on_tokens is not None,
            draft_sample_method=self.options.draft_sample_method,
            every_step_kind=every_step_kind,
        )
        validate_request(request, self.config, self.speculates)
        self._inbox.put(("generate", request))
        return self._wait_for("result", self.silence_limit_s, on_partial=on_tokens)[2]

    def start_continuous(self, num_speculative_tokens: int | None = None) -> None:
        """Switch the ranks to continuous batching (runtime/decode/continuous.py) until the engine closes: requests
        `join` and `cancel` between steps, and `next_updates` brings each step's news."""
        if self._closed:
            raise PipelineError("the engine is closed")
        k = self.options.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        validate_speculative_tokens(k, self.speculates)
        self.continuous_k = k
        sampled_drafts = self.options.draft_sample_method == DraftSampleMethod.PROBABILISTIC
        self._inbox.put(("continuous", (k, sampled_drafts, self.options.adaptive_speculation)))

    def join(self, request_id: str, sequence: SequenceRequest) -> None:
        """Queue a request to join the running batch before the next step (checked here, not on the ranks)."""
        validate_sequences([sequence], self.continuous_k, self.config, self.speculates)
        self._inbox.put((JOIN, (request_id, sequence)))

    def cancel(self, request_id: str) -> None:
        """Drop a request from the running batch before the next step (unknown or finished ids are ignored)."""
        self._inbox.put((CANCEL, request_id))

    def next_updates(self) -> dict[str, RowUpdate]:
        """The next step's news per request (empty: a beat while nothing changed); raises when the pipeline fails."""
        if self._closed:
            raise PipelineError("the engine is closed")
        return self._wait_for("updates", self.silence_limit_s)[2]

    @property
    def alive(self) -> bool:
        return not self._closed and all(process.exitcode is None for process in self._processes)

    def prompt_logits(self, prompts: list[list[int]]) -> torch.Tensor:
        """Target logits at every prompt position, [B, Lmax, V], computed through the whole pipeline."""
        if self._closed:
            raise PipelineError("the engine is closed")
        self._inbox.put(("score", prompts))
        return self._wait_for("logits", self.silence_limit_s)[2]

    def probe_taps(self, prompt: list[int]) -> list[TapReading]:
        """Which target layer each of a block drafter's taps holds, on `prompt` through the live pipeline."""
        if not (self.drafter and self.drafter.taps):
            raise SpecdoctorError("the tap probe needs a drafter that reads the target's taps")
        if self._closed:
            raise PipelineError("the engine is closed")
        self._inbox.put(("probe_taps", prompt))
        return self._wait_for("probe_taps", self.silence_limit_s)[2]

    def finish_compiles(self) -> None:
        """Wait until every rank has compiled (or loaded) the graphs its passes asked for so far, and runs them
        (`bench` times compiled steps); minutes from a cold compile cache."""
        if self.options.compile:
            self._ask("finish_compiles")

    def measure_drafter(self) -> DrafterState:
        """What the live drafter holds, measured on its rank."""
        return self._ask("measure_drafter")

    def repair_drafter(self, names: list[str] | dict[int, list[str]]) -> RepairResult:
        """Fill the named drafter tensors from the checkpoint, on the drafter's stage (by TP rank: each its own)."""
        return self._ask("repair_drafter", names=names)

    def _ask(self, kind: str, **payload):
        if self._closed:
            raise PipelineError("the engine is closed")
        self._inbox.put((kind, payload))
        return self._wait_for(kind, self.silence_limit_s)[2]

    def _next_reply(self, timeout: float) -> tuple | None:
        """The next (kind, rank, payload) any rank sent, or None when none came within `timeout`."""
        for reply in wait_for_any(self._replies, timeout):
            try:
                return reply.recv()
            except EOFError:  # the rank exited; its exit code says how
                self._replies.remove(reply)
        return None

    def _wait_for(self, wanted: str, silence_limit_s: float | None, on_partial=None) -> tuple:
        last_heard = time.monotonic()
        while True:
            message = self._next_reply(timeout=0.2)
            if message is None:
                self._raise_if_a_rank_died()
                silent_for = time.monotonic() - last_heard
                if silence_limit_s is not None and silent_for > silence_limit_s:
                    self._raise_silent_pipeline(silent_for)
                continue
            last_heard = time.monotonic()
            kind, rank, payload = message
            if kind == "compile":
                self.compile_status[rank] = payload
                if self.on_compile_status:
                    self.on_compile_status(dict(self.compile_status))
                continue
            if kind in ERRORS:
                time.sleep(0.5)  # let a peer's death and its own report arrive, so the root cause is named
                reported = self._root_cause([payload] if kind == "error" else [], [payload])
                self._raise_if_a_rank_died(reported=reported)
                self._closed = True
                raise PipelineError(reported)
            if kind == wanted:
                return kind, rank, payload
            if kind == "partial" and on_partial:
                on_partial(payload)

    def _raise_if_a_rank_died(self, reported: str | None = None) -> None:
        dead = [(rank, p.exitcode) for rank, p in enumerate(self._processes) if p.exitcode is not None]
        if not dead:
            return
        self._closed = True
        # A rank killed by a signal is the root cause; the others exited after losing it.
        rank, code = min(dead, key=lambda item: (item[1] >= 0, item[0]))
        if code >= 0:
            reported = reported or self._root_cause([], [])
            if reported:
                raise PipelineError(reported)
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise PipelineError(f"pipeline rank {rank} (pid {self._processes[rank].pid}) {how}")

    def _root_cause(self, own: list[str], consequences: list[str]) -> str | None:
        """Of the errors reported so far and those still arriving, the first a rank raised itself
        (its computation failed); else the first about a peer (a consequence of another's failure)."""
        while (message := self._next_reply(timeout=0.5)) is not None:
            kind, _rank, payload = message
            if kind in ERRORS:
                (own if kind == "error" else consequences).append(payload)
        return (own or consequences or [None])[0]

    def _raise_silent_pipeline(self, silent_for: float) -> None:
        self._closed = True
        stopped = [rank for rank, process in enumerate(self._processes) if process_state(process.pid) in ("T", "t")]
        if stopped:
            who = ", ".join(f"rank {rank} (pid {self._processes[rank].pid})" for rank in stopped)
            raise PipelineError(f"pipeline {who} stopped (SIGSTOP or a debugger): no reply for {silent_for:.0f} s")
        pids = ", ".join(str(pid) for pid in self.rank_pids)
        raise PipelineError(f"no reply from the pipeline for {silent_for:.0f} s; its ranks (pids {pids}) are alive")

    def close(self, grace_s: float = 10.0) -> None:
        """Ask the ranks to shut down and give them `grace_s` to do so; then stop them. At once for a failed
        pipeline, which holds nothing worth a clean exit, and when closed while Ctrl-C or SIGTERM unwinds the
        caller (its `finally` or `with`): a rank stuck in a long step would not read "shutdown" for minutes."""
        if isinstance(sys.exc_info()[1], KeyboardInterrupt):
            grace_s = 0
        started = [process for process in self._processes if process.pid is not None]  # stopped while starting
        healthy = not self._closed and all(p.exitcode is None for p in self._processes)
        if healthy:
            self._inbox.put(("shutdown", None))
        self._closed = True
        self._inbox.cancel_join_thread()  # a dead first rank never reads; do not block this process's exit
        deadline = time.time() + (grace_s if healthy else 0)
        for process in started:
            process.join(timeout=max(0.1, deadline - time.time()))
        for process in started:
            if process.is_alive():
                kill_descendants(process.pid)  # its compilers, which would compile on as orphans
                process.kill()
                process.join(timeout=5)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
