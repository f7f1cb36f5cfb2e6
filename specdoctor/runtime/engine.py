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

import torch
from rich.console import Console
from rich.progress import Progress

from specdoctor.errors import PipelineError, SpecdoctorError
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import model_eos_token_ids
from specdoctor.runtime.compile_status import CompileStatus
from specdoctor.runtime.decode.continuous import RowUpdate
from specdoctor.runtime.decode.grammar import GrammarRequest
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
from specdoctor.runtime.launch import free_port, kill_descendants, rank_context, stop_signals_held
from specdoctor.runtime.moe_paths import fewest_grouped_tokens
from specdoctor.runtime.options import DraftSampleMethod, RuntimeOptions
from specdoctor.runtime.partition import placements
from specdoctor.runtime.protocol import Command, ContinuousStart, Join, Order, RankReply, Reply
from specdoctor.runtime.rank_replies import RankReplies
from specdoctor.runtime.refusals import runtime_refusal
from specdoctor.runtime.sampling import SamplingParams
from specdoctor.runtime.tap_probe import TapReading
from specdoctor.runtime.worker import rank_main


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
        world = options.pp * options.tp  # TP ranks inner, pipeline stages outer (runtime/comm.py)
        pipes = [context.Pipe(duplex=False) for _ in range(world)]  # one reply pipe per rank (rank_replies.py)
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
        self._replies = RankReplies([reader for reader, _ in pipes], self._processes, self._compile_reported)
        try:
            with stop_signals_held():
                for process in self._processes:
                    process.start()
            for _, writer in pipes:
                writer.close()  # only the rank holds its write end now, so its exit reads as end-of-file
            self._wait_until_ready(show_progress)
        except BaseException:
            self.close(grace_s=0)  # ranks still loading would only read SHUTDOWN once loaded
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
                ready = self._wait_for(Reply.READY, None)
                self.rank_info[ready.rank] = ready.payload
                progress.advance(task)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int] = 64,
        sampling: SamplingParams = SamplingParams(),
        num_speculative_tokens: int | None = None,
        on_tokens=None,
        every_step_kind: bool = False,
        grammar: GrammarRequest | None = None,
    ) -> GenerateResult:
        """Generate for a batch; `on_tokens(tokens per prompt so far)` is called after every step. `every_step_kind`:
        serve's warm-up (GenerateRequest); `grammar`: structured output for every prompt."""
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
            grammar=grammar,
        )
        validate_request(request, self.config, self.speculates)
        self._inbox.put(Order(Command.GENERATE, request))
        return self._wait_for(Reply.RESULT, self.silence_limit_s, on_partial=on_tokens).payload

    def start_continuous(self, num_speculative_tokens: int | None = None) -> None:
        """Switch the ranks to continuous batching (runtime/decode/continuous.py) until the engine closes: requests
        `join` and `cancel` between steps, and `next_updates` brings each step's news."""
        if self._closed:
            raise PipelineError("the engine is closed")
        k = self.options.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        validate_speculative_tokens(k, self.speculates)
        self.continuous_k = k
        sampled_drafts = self.options.draft_sample_method == DraftSampleMethod.PROBABILISTIC
        self._inbox.put(
            Order(Command.CONTINUOUS, ContinuousStart(k, sampled_drafts, self.options.adaptive_speculation))
        )

    def join(self, request_id: str, sequence: SequenceRequest) -> None:
        """Queue a request to join the running batch before the next step (checked here, not on the ranks)."""
        validate_sequences([sequence], self.continuous_k, self.config, self.speculates)
        self._inbox.put(Order(Command.JOIN, Join(request_id, sequence)))

    def cancel(self, request_id: str) -> None:
        """Drop a request from the running batch before the next step (unknown or finished ids are ignored)."""
        self._inbox.put(Order(Command.CANCEL, request_id))

    def next_updates(self) -> dict[str, RowUpdate]:
        """The next step's news per request (empty: a beat while nothing changed); raises when the pipeline fails."""
        if self._closed:
            raise PipelineError("the engine is closed")
        return self._wait_for(Reply.UPDATES, self.silence_limit_s).payload

    @property
    def alive(self) -> bool:
        return not self._closed and all(process.exitcode is None for process in self._processes)

    def prompt_logits(self, prompts: list[list[int]]) -> torch.Tensor:
        """Target logits at every prompt position, [B, Lmax, V], computed through the whole pipeline."""
        if self._closed:
            raise PipelineError("the engine is closed")
        return self._ask(Command.SCORE, prompts, Reply.LOGITS)

    def probe_taps(self, prompt: list[int]) -> list[TapReading]:
        """Which target layer each of a block drafter's taps holds, on `prompt` through the live pipeline."""
        if not (self.drafter and self.drafter.taps):
            raise SpecdoctorError("the tap probe needs a drafter that reads the target's taps")
        return self._ask(Command.PROBE_TAPS, prompt, Reply.TAP_READINGS)

    def finish_compiles(self) -> None:
        """Wait until every rank has compiled (or loaded) the graphs its passes asked for so far, and runs them
        (`bench` times compiled steps); minutes from a cold compile cache."""
        if self.options.compile:
            self._ask(Command.FINISH_COMPILES, None, Reply.COMPILES_FINISHED)

    def measure_drafter(self) -> DrafterState:
        """What the live drafter holds, measured on its rank."""
        return self._ask(Command.MEASURE_DRAFTER, {}, Reply.DRAFTER_STATE)

    def repair_drafter(self, broken: dict[int, list[str]]) -> RepairResult:
        """Fill the broken drafter tensors from the checkpoint, on the drafter's stage: each TP rank its own."""
        return self._ask(Command.REPAIR_DRAFTER, {"names": broken}, Reply.REPAIRED)

    def _ask(self, command: Command, payload, answer: Reply):
        if self._closed:
            raise PipelineError("the engine is closed")
        self._inbox.put(Order(command, payload))
        return self._wait_for(answer, self.silence_limit_s).payload

    def _wait_for(self, wanted: Reply, silence_limit_s: float | None, on_partial=None) -> RankReply:
        try:
            return self._replies.wait_for(wanted, silence_limit_s, on_partial)
        except PipelineError:  # a failed pipeline takes no more requests
            self._closed = True
            raise

    def _compile_reported(self, rank: int, status: CompileStatus) -> None:
        self.compile_status[rank] = status
        if self.on_compile_status:
            self.on_compile_status(dict(self.compile_status))

    def close(self, grace_s: float = 10.0) -> None:
        """Ask the ranks to shut down and give them `grace_s` to do so; then stop them. At once for a failed
        pipeline, which holds nothing worth a clean exit, and when closed while Ctrl-C or SIGTERM unwinds the
        caller (its `finally` or `with`): a rank stuck in a long step would not read SHUTDOWN for minutes."""
        if isinstance(sys.exc_info()[1], KeyboardInterrupt):
            grace_s = 0
        started = [process for process in self._processes if process.pid is not None]  # stopped while starting
        healthy = not self._closed and all(p.exitcode is None for p in self._processes)
        if healthy:
            self._inbox.put(Order(Command.SHUTDOWN))
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
