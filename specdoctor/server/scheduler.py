"""Queues requests and runs them through the engine in batches, one batch at a time.

Greedy requests with the same k share a batch (their outputs do not depend on each other);
sampled requests run alone, so a seed reproduces the same text whatever else is in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdoctor.runtime.engine import Engine
from specdoctor.runtime.sampling import SamplingParams
from specdoctor.server.metrics import ServerMetrics


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    on_tokens: Callable[[list[int]], None] | None = None  # runs on the event loop with the tokens so far
    arrived: float = field(default_factory=time.perf_counter)
    first_token_seen: bool = False
    future: asyncio.Future | None = None


class BatchScheduler:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_batch: int = 32):
        self.engine, self.metrics, self.max_batch = engine, metrics, max_batch
        self.waiting: deque[Job] = deque()
        self.wakeup = asyncio.Event()

    async def submit(self, job: Job):
        """(tokens, finish reason, the request's speculative counters) once the job's batch is done."""
        job.future = asyncio.get_running_loop().create_future()
        self.waiting.append(job)
        self.wakeup.set()
        return await job.future

    def _next_batch(self) -> list[Job]:
        first = self.waiting.popleft()
        if not first.sampling.greedy:
            return [first]
        batch, others = [first], deque()
        while self.waiting and len(batch) < self.max_batch:
            job = self.waiting.popleft()
            (batch if job.sampling.greedy else others).append(job)
        self.waiting.extendleft(reversed(others))
        return batch

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.waiting:
                batch = self._next_batch()

                def on_tokens(token_lists: list[list[int]], batch=batch) -> None:  # engine thread
                    loop.call_soon_threadsafe(self._deliver, batch, [list(t) for t in token_lists])

                try:
                    result = await asyncio.to_thread(
                        self.engine.generate,
                        [job.prompt_ids for job in batch],
                        [job.max_tokens for job in batch],
                        batch[0].sampling,
                        None,
                        on_tokens,
                    )
                except Exception as err:  # a dead rank: every request of the batch fails, none hangs
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(err)
                    continue
                for index, job in enumerate(batch):
                    if not job.future.done():
                        job.future.set_result(
                            (result.tokens[index], result.finish_reasons[index], result.row_metrics[index])
                        )

    def _deliver(self, batch: list[Job], token_lists: list[list[int]]) -> None:
        for job, tokens in zip(batch, token_lists, strict=True):
            if tokens and not job.first_token_seen:
                job.first_token_seen = True
                self.metrics.record_ttft(time.perf_counter() - job.arrived)
            if job.on_tokens:
                job.on_tokens(tokens)
