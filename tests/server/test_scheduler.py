"""The server's continuous-batching scheduler (server/scheduler.py): admission up to max_num_seqs in arrival
order, a bounded queue (a 429 past it, a request refused whole), each step's news gathered into its job,
stop strings, cancellation (by the server or a client that went away) and a failed pipeline.

The engine is the one stand-in: a real Engine needs rank processes, so `BatchEngine` below answers the
calls the scheduler makes of one (start_continuous, join, cancel, next_updates), keeping the running
batch's request ids as the ranks' RunningBatch does and handing out the RowUpdates a test scripts."""

from __future__ import annotations

import asyncio
import gc
import queue
import time

import pytest

from specdoctor.errors import PipelineError
from specdoctor.runtime.decode.continuous import RowUpdate
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.decode.requests import SequenceRequest
from specdoctor.server.metrics import ServerMetrics
from specdoctor.server.protocol import RequestError
from specdoctor.server.scheduler import ContinuousScheduler, Job
from tests.helpers.heap import collector_walks


class BatchEngine:
    """The running batch's request ids, in the order they joined; each next_updates hands out the next
    scripted news (or raises a scripted failure), and an empty beat when there is none yet."""

    def __init__(self):
        self.batch: list[str] = []
        self.sequences: dict[str, SequenceRequest] = {}
        self.continuous = False
        self.news: queue.Queue[dict[str, RowUpdate] | Exception] = queue.Queue()

    def start_continuous(self) -> None:
        self.continuous = True

    def join(self, request_id: str, sequence: SequenceRequest) -> None:
        self.batch.append(request_id)
        self.sequences[request_id] = sequence

    def cancel(self, request_id: str) -> None:  # unknown or finished ids are ignored, as the Engine's
        if request_id in self.batch:
            self.batch.remove(request_id)

    def next_updates(self) -> dict[str, RowUpdate]:
        try:
            news = self.news.get(timeout=0.02)
        except queue.Empty:
            return {}
        if isinstance(news, Exception):
            raise news
        for request_id, update in news.items():  # finished rows leave the batch, as RunningBatch.updates does
            if update.finish_reason and request_id in self.batch:
                self.batch.remove(request_id)
        return news


def job(prompt_length: int = 3, **fields) -> Job:
    return Job(SequenceRequest(list(range(1, prompt_length + 1)), 16), **fields)


def update(tokens: list[int], reason: str | None = None, accepted: int = 0) -> RowUpdate:
    metrics = SpecMetrics()
    metrics.record(accepted, 3)
    return RowUpdate(tokens, reason, metrics, [(-0.5 * (i + 1), [(t, -0.1)]) for i, t in enumerate(tokens)])


def run(test, max_running: int = 32, max_waiting: int = 256):
    """Run `test(scheduler, engine)` on an event loop, with the scheduler's run() delivering the news."""
    engine, metrics = BatchEngine(), ServerMetrics("demo", speculative=True)
    scheduler = ContinuousScheduler(engine, metrics, max_running, max_waiting)

    async def main():
        serving = asyncio.create_task(scheduler.run())
        try:
            return await asyncio.wait_for(test(scheduler, engine), timeout=10)
        finally:
            serving.cancel()

    return asyncio.run(main()), scheduler, engine, metrics


async def done(scheduler: ContinuousScheduler, *jobs: Job) -> list[Job]:
    return [await scheduler.result(j) for j in jobs]


def test_admits_up_to_max_running_in_arrival_order_and_the_next_waiting_one_takes_a_freed_place():
    jobs = [job() for _ in range(5)]

    async def test(scheduler, engine):
        scheduler.enqueue(jobs[:2])  # a request with two choices
        scheduler.enqueue([jobs[2]])
        scheduler.enqueue(jobs[3:])
        assert engine.batch == [jobs[0].id, jobs[1].id]
        assert list(scheduler.waiting) == jobs[2:] and list(scheduler.running) == engine.batch
        assert engine.sequences[jobs[0].id] is jobs[0].sequence
        engine.news.put({jobs[1].id: update([4], "length")})
        await scheduler.result(jobs[1])
        assert engine.batch == [jobs[0].id, jobs[2].id] and list(scheduler.waiting) == jobs[3:]
        engine.news.put({jobs[0].id: update([5], "length"), jobs[2].id: update([6], "stop")})
        await done(scheduler, jobs[0], jobs[2])
        assert engine.batch == [jobs[3].id, jobs[4].id] and not scheduler.waiting

    run(test, max_running=2)


def test_a_full_queue_is_a_429_and_a_request_is_refused_whole():
    first, queued = job(), [job(), job()]
    refused, pair = job(), [job(), job()]

    async def test(scheduler, engine):
        scheduler.enqueue([first])  # runs at once: the queue stays empty
        scheduler.enqueue(queued[:1])
        with pytest.raises(RequestError) as full:
            scheduler.enqueue(pair)  # 1 waiting + 2 > 2: neither choice is queued
        assert full.value.status == 429 and full.value.kind == "rate_limit_error"
        assert "1 requests running and 1 waiting" in str(full.value)
        assert list(scheduler.waiting) == queued[:1] and all(j.future is None for j in pair)
        scheduler.enqueue(queued[1:])
        with pytest.raises(RequestError) as again:
            scheduler.enqueue([refused])
        assert again.value.status == 429 and list(scheduler.waiting) == queued
        assert engine.batch == [first.id]

    run(test, max_running=1, max_waiting=2)


def test_each_steps_news_gathers_into_the_job_until_it_finishes():
    seen: list[list[int]] = []
    streamed = job(7, on_tokens=lambda: seen.append(list(streamed.tokens)))

    async def test(scheduler, engine):
        scheduler.enqueue([streamed])
        engine.news.put({streamed.id: update([11, 12], accepted=2)})
        engine.news.put({streamed.id: update([], None)})  # a step that emitted nothing for this row
        last = update([13], "length", accepted=1)
        engine.news.put({streamed.id: last})
        finished = await scheduler.result(streamed)
        assert finished is streamed
        return last

    last, scheduler, engine, metrics = run(test)
    assert streamed.tokens == [11, 12, 13] and streamed.finish_reason == "length"
    assert streamed.logprobs == [(-0.5, [(11, -0.1)]), (-1.0, [(12, -0.1)]), (-0.5, [(13, -0.1)])]
    assert streamed.metrics is last.metrics  # the counters so far: the latest update's
    assert seen == [[11, 12], [11, 12, 13]]  # once per update that brought tokens, the tokens so far
    assert engine.continuous and not scheduler.running and engine.batch == []
    # Time to first token: observed once, at the first update with tokens.
    assert metrics.registry.get_sample_value("vllm:time_to_first_token_seconds_count", {"model_name": "demo"}) == 1


def test_a_stop_string_ends_the_request_at_once_and_takes_it_out_of_the_engine():
    stopping = job(should_stop=lambda tokens: 99 in tokens)
    waiting = job()

    async def test(scheduler, engine):
        scheduler.enqueue([stopping, waiting])
        engine.news.put({stopping.id: update([5, 6])})
        engine.news.put({stopping.id: update([99, 7])})  # the engine has not finished it: the server does
        await scheduler.result(stopping)
        assert engine.batch == [waiting.id]  # cancelled in the engine, its place given to the next
        return scheduler

    run(test, max_running=1)
    assert stopping.finish_reason == "stop" and stopping.tokens == [5, 6, 99, 7]  # Reply.finish trims them


def test_a_request_whose_stop_check_fails_fails_alone_and_the_steps_other_news_is_delivered():
    """A tokenizer that raises while a stop string is looked for: that request ends with the error, and the others
    in the same step still get their tokens and finish (the place it held goes to the next)."""
    failing = job(should_stop=lambda tokens: 1 / 0)
    finishing, waiting = job(), job()

    async def test(scheduler, engine):
        scheduler.enqueue([failing, finishing, waiting])
        engine.news.put({failing.id: update([5]), finishing.id: update([6], "length")})
        with pytest.raises(ZeroDivisionError):
            await scheduler.result(failing)
        assert (await scheduler.result(finishing)).tokens == [6]
        assert engine.batch == [waiting.id] and list(scheduler.running) == [waiting.id]

    run(test, max_running=2)


def test_cancelling_frees_a_running_requests_place_or_takes_a_waiting_one_off_the_queue():
    a, b, c = job(), job(), job()

    async def test(scheduler, engine):
        scheduler.enqueue([a, b, c])
        scheduler.cancel(b)  # waiting: the engine never hears of it
        assert list(scheduler.waiting) == [c] and engine.batch == [a.id]
        scheduler.cancel(a)
        assert engine.batch == [c.id] and list(scheduler.running) == [c.id] and not scheduler.waiting
        # The step that was under way still reports the cancelled request: its news is dropped.
        engine.news.put({a.id: update([1]), c.id: update([2], "length")})
        await scheduler.result(c)
        assert not a.future.done() and a.tokens == [] and c.tokens == [2]

    run(test, max_running=1)


def test_a_client_that_goes_away_frees_its_place():
    gone, next_one = job(), job()

    async def test(scheduler, engine):
        scheduler.enqueue([gone, next_one])
        waiter = asyncio.create_task(scheduler.result(gone))
        engine.news.put({gone.id: update([3])})
        deadline = time.monotonic() + 10
        while gone.tokens != [3]:  # the first tokens arrived: the request is under way
            assert time.monotonic() < deadline, "the update never arrived"
            await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert engine.batch == [next_one.id] and list(scheduler.running) == [next_one.id]

    run(test, max_running=1)


def test_a_failed_pipeline_fails_every_request_and_refuses_new_ones_with_a_503():
    running, waiting = job(), job()
    failure = PipelineError("rank 1: receiving hidden states from rank 0 failed (closed)")

    async def test(scheduler, engine):
        scheduler.enqueue([running, waiting])
        engine.news.put(failure)
        for j in (running, waiting):
            with pytest.raises(PipelineError) as raised:
                await scheduler.result(j)
            assert raised.value is failure
        assert not scheduler.running and not scheduler.waiting
        with pytest.raises(RequestError) as refused:
            scheduler.enqueue([job()])
        assert refused.value.status == 503 and "the pipeline is down" in str(refused.value)

    run(test, max_running=1)


def test_serving_freezes_the_start_up_heap_so_a_full_collection_skips_it():
    """A full collection walked the server's start-up objects for 100-200 ms mid-request (runtime/heap.py); once
    serving ends they are the collector's again (an interpreter that exits frees them)."""
    from_start_up = []  # a tracked object that lives on, as the app's and the tokenizer's do

    async def test(scheduler, engine):
        await asyncio.sleep(0)  # run() has started serving
        made_while_serving = []
        assert engine.continuous and gc.get_freeze_count() > 0
        assert not collector_walks(from_start_up)
        assert collector_walks(made_while_serving)

    run(test)
    assert gc.get_freeze_count() == 0 and collector_walks(from_start_up)
