"""Continuous batching for the server: requests join the engine's running batch between steps and leave
it as soon as they finish (their limit, a stop token id, a stop string, or a client that went away).

The engine's ranks do the batching (runtime/decode/continuous.py); this side keeps at most `max_running`
requests in the engine, queues up to `max_waiting` more, and refuses the rest with a 429.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdoctor.runtime.decode.continuous import RowUpdate
from specdoctor.runtime.decode.logprobs import PromptLogprob, TokenLogprob
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.decode.requests import SequenceRequest
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.heap import frozen_startup_heap
from specdoctor.server.metrics import ServerMetrics
from specdoctor.server.protocol import RequestError


@dataclass
class Job:
    sequence: SequenceRequest
    on_tokens: Callable[[], None] | None = None  # runs on the event loop when the job gained tokens
    should_stop: Callable[[list[int]], bool] | None = None  # a stop string appeared: end the request now
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrived: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asked
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    cached_tokens: int = 0  # prompt tokens prefix caching restored
    prompt_logprobs: list[PromptLogprob] | None = None  # when the request asked
    finish_reason: str | None = None
    stop_token: int | None = None  # the stop token id that ended it, not in `tokens` (its text is not the output's)
    future: asyncio.Future | None = None

    def output_ids(self) -> list[int]:
        """The output's token ids as vLLM reports and counts them: with the stop token id that ended it."""
        return self.tokens if self.stop_token is None else [*self.tokens, self.stop_token]


class ContinuousScheduler:
    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        max_running: int = 32,
        max_waiting: int = 256,
        warm_up: Callable[[], None] | None = None,
    ):
        self.engine, self.metrics, self.warm_up = engine, metrics, warm_up
        self.started = False  # the engine runs continuous batching: requests may join
        self.max_running, self.max_waiting = max_running, max_waiting
        self.waiting: deque[Job] = deque()
        self.running: dict[str, Job] = {}
        self.failure: Exception | None = None
        self.stopping = False

    def enqueue(self, jobs: list[Job]) -> None:
        """Queue a request's jobs, all or none: a full queue is a 429, a failed pipeline its error."""
        if self.failure:
            raise RequestError(f"the pipeline is down: {self.failure}", status=503, kind="server_error")
        if self.stopping:
            raise RequestError("the server is shutting down", status=503, kind="server_error")
        if len(self.waiting) + len(jobs) > self.max_waiting:
            raise RequestError(
                f"the server is full: {len(self.running)} requests running and {len(self.waiting)} waiting",
                status=429,
                kind="rate_limit_error",
            )
        loop = asyncio.get_running_loop()
        for job in jobs:
            job.future = loop.create_future()
            self.waiting.append(job)
        self._admit()

    async def result(self, job: Job) -> Job:
        """The job, once done: its tokens, log-probabilities, finish reason and speculative counters."""
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:  # the client went away: free its place at once
            self.cancel(job)
            raise

    def cancel(self, job: Job) -> None:
        if job.id in self.running:
            del self.running[job.id]
            self.engine.cancel(job.id)
            self._admit()
        elif job in self.waiting:
            self.waiting.remove(job)

    def stop(self) -> None:
        """The server is shutting down: every request ends now with the tokens it has, finish reason "abort"
        (vLLM's for a request the engine dropped), so an open stream sends its last chunk and closes."""
        self.stopping = True
        for job in [*self.running.values(), *self.waiting]:
            if job.id in self.running:
                self.engine.cancel(job.id)
            job.finish_reason = "abort"
            if not job.future.done():
                job.future.set_result(job)
        self.running.clear()
        self.waiting.clear()

    async def run(self) -> None:
        """Warm up (requests queue meanwhile), start the engine's continuous batching and deliver its news until the
        engine closes or fails."""
        loop = asyncio.get_running_loop()
        if self.warm_up:
            try:
                await asyncio.to_thread(self.warm_up)
            except Exception as err:  # a rank died warming up: the queued requests fail, as in serving
                self._fail(err)
                return
        self.engine.start_continuous()
        self.started = True
        self._admit()
        stopped = threading.Event()

        def listen() -> None:  # a thread: the engine's replies block
            try:
                while not stopped.is_set():
                    news = self.engine.next_updates()
                    if news:
                        loop.call_soon_threadsafe(self._deliver, news)
            except Exception as err:  # a dead rank: every request in flight fails, none hangs
                if not stopped.is_set():
                    loop.call_soon_threadsafe(self._fail, err)

        listener = threading.Thread(target=listen, name="specdoctor-updates", daemon=True)
        listener.start()
        try:
            with frozen_startup_heap():  # the app, the tokenizer, torch: no full collection walks them mid-request
                await asyncio.Event().wait()  # until the server shuts down and cancels this task
        finally:
            stopped.set()

    def _admit(self) -> None:
        while self.started and self.waiting and len(self.running) < self.max_running and not self.failure:
            job = self.waiting.popleft()
            self.running[job.id] = job
            self.engine.join(job.id, job.sequence)

    def _deliver(self, news: dict[str, RowUpdate]) -> None:
        for request_id, update in news.items():
            job = self.running.get(request_id)
            if job is None:  # cancelled after this step began
                continue
            if update.new_tokens and not job.tokens:
                self.metrics.record_ttft(time.perf_counter() - job.arrived)
            job.tokens += update.new_tokens
            job.logprobs += update.new_logprobs
            job.metrics, job.cached_tokens = update.metrics, update.cached_tokens
            job.prompt_logprobs = job.prompt_logprobs or update.prompt_logprobs
            reason = update.finish_reason
            try:
                stopping = reason is None and job.should_stop is not None and job.should_stop(job.tokens)
            except Exception as err:  # its text cannot be decoded: this request fails, the step's others go on
                self.cancel(job)
                job.future.set_exception(err)
                continue
            if stopping:
                reason = "stop"
                self.engine.cancel(request_id)
            if job.on_tokens and update.new_tokens:
                job.on_tokens()
            if reason is not None:
                del self.running[request_id]
                job.finish_reason, job.stop_token = reason, update.stop_token
                if not job.future.done():
                    job.future.set_result(job)
        self._admit()

    def _fail(self, err: Exception) -> None:
        self.failure = err
        for job in [*self.running.values(), *self.waiting]:
            if not job.future.done():
                job.future.set_exception(err)
        self.running.clear()
        self.waiting.clear()
