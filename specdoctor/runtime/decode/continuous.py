"""Continuous batching (iteration-level scheduling), run by every rank in lockstep.

Between two decode steps the first rank takes what the controller queued (requests to join,
requests to cancel) and broadcasts it; every rank then runs the joiners' prompt pass on their own,
appends their rows to the running batch, and drops the rows that finished or were cancelled. Rows
are independent (positions, caches, recurrent states and generators are per row), so a request's
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdoctor.runtime.decode.adaptive import SpeculationPolicy
from specdoctor.runtime.decode.batch import BatchState
from specdoctor.runtime.decode.logprobs import PromptLogprob, TokenLogprob
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.decode.pipeline import RankModel
from specdoctor.runtime.decode.requests import SequenceRequest
from specdoctor.runtime.protocol import Command, ContinuousStart, Join, Order


@dataclass(frozen=True)
class RowUpdate:
    """What a request gained in one step: its new tokens, why it finished (None while it runs) and its
    speculative counters so far."""

    new_tokens: list[int]
    finish_reason: str | None
    metrics: SpecMetrics
    new_logprobs: list[TokenLogprob]  # one per new token when the request asked for log-probabilities
    cached_tokens: int = 0  # prompt tokens prefix caching restored
    prompt_logprobs: list[PromptLogprob] | None = None  # with the request's first tokens, where it asked
    stop_token: int | None = None  # with the finish: the stop token id that ended it (not in new_tokens)


class RunningBatch:
    def __init__(self, model: RankModel, k: int, sampled_drafts: bool, adaptive: bool = False):
        self.model, self.k, self.sampled_drafts = model, k, sampled_drafts
        # adaptive: a step speculates only where speculative steps yielded more (runtime/decode/adaptive.py)
        self.policy = SpeculationPolicy() if adaptive and k else None
        self.batch: BatchState | None = None
        self.ids: list[str] = []
        self.reported: list[int] = []  # tokens of each row already reported

    def apply(self, orders: list[Order]) -> None:
        """Drop cancelled rows, then prefill and append the joiners (those not cancelled already)."""
        cancelled = {payload for command, payload in orders if command == Command.CANCEL}
        joins: list[Join] = [
            payload for command, payload in orders if command == Command.JOIN and payload.request_id not in cancelled
        ]
        self._keep([row for row, request_id in enumerate(self.ids) if request_id not in cancelled])
        if joins:
            sequences: list[SequenceRequest] = [join.sequence for join in joins]
            joined = BatchState(self.model, sequences, self.k, self.sampled_drafts)
            joined.prefill()
            self.batch = joined if self.batch is None else BatchState.regroup([self.batch, joined])
            self.ids += [join.request_id for join in joins]
            self.reported += [0] * len(joins)

    def speculates_next(self, joining: list[SequenceRequest] = ()) -> bool:
        """Whether the coming step proposes drafts for the one after, with `joining` about to join: always without a
        policy, and while a row samples with a seed (a plain step would draw from its generator in another order
        than it does alone); else as the policy says for the rows there will be. Asked once a step."""
        if self.policy is None:
            return True
        rows = len(self.ids) + len(joining)
        sequences = [*(self.batch.sequences if self.batch else []), *joining]
        if not rows or any(sequence.sampling.seeded for sequence in sequences):
            return True
        return self.policy.speculate(rows)

    def step(self, propose_next: bool | None = None) -> None:
        """One decode step; `propose_next` as the first rank's `speculates_next` said (None: ask it here)."""
        if self.batch is None:
            return
        if propose_next is None:
            propose_next = self.speculates_next()
        batch, rows, started = self.batch, len(self.ids), time.perf_counter()
        before = sum(len(tokens) for tokens in batch.result.tokens) if self.policy else 0
        batch.step(propose_next)
        batch.commit(count_metrics=True)
        batch.advance()
        batch.result.proposals.clear()  # only `check` reads them; a server would hoard them
        # A step that switches kinds (it speculated and only filled, or it proposed after a plain step) is left out:
        # the one run slower, the other faster, than the kind runs while it stays.
        if self.policy and batch.stepped_speculatively == propose_next:
            emitted = sum(len(tokens) for tokens in batch.result.tokens) - before
            self.policy.observe(propose_next, rows, emitted, time.perf_counter() - started)

    def updates(self) -> dict[str, RowUpdate]:
        """Each row's news since the last call; finished rows leave the batch."""
        if self.batch is None:
            return {}
        result, news = self.batch.result, {}
        for row, request_id in enumerate(self.ids):
            tokens, reason = result.tokens[row], result.finish_reasons[row] or None
            if len(tokens) > self.reported[row] or reason:
                new = slice(self.reported[row], None)
                prompt, result.prompt_logprobs[row] = result.prompt_logprobs[row], None  # sent once
                news[request_id] = RowUpdate(
                    tokens[new],
                    reason,
                    result.row_metrics[row],
                    result.logprobs[row][new],
                    result.cached_tokens[row],
                    prompt,
                    result.stop_tokens[row],
                )
                self.reported[row] = len(tokens)
        self._keep([row for row, active in enumerate(self.batch.active) if active])
        return news

    def _keep(self, rows: list[int]) -> None:
        if self.batch is None or len(rows) == len(self.ids):
            return
        self.batch = BatchState.regroup([self.batch], rows) if rows else None
        self.ids = [self.ids[row] for row in rows]
        self.reported = [self.reported[row] for row in rows]


@torch.no_grad()
def run_continuous(
    model: RankModel,
    start: ContinuousStart,
    poll: Callable[[bool], list[Order]] | None,
    report: Callable[[dict[str, RowUpdate]], None] | None,
) -> None:
    """Serve until the controller says shutdown. Only the first rank has `poll(idle)` (the queued orders; it
    waits for one when idle); only the reporting rank has `report` (every step's news, and an empty beat at least
    once a second so the controller can tell a quiet pipeline from a dead one)."""
    running, last_report = RunningBatch(model, start.k, start.sampled_drafts, start.adaptive), time.monotonic()
    while True:
        step = None
        if poll:  # the first rank's policy chooses for every rank: each rank times only its own share of a step
            orders = poll(running.batch is None)
            joining = [payload.sequence for command, payload in orders if command == Command.JOIN]
            step = orders, running.speculates_next(joining)
        orders, propose_next = model.comm.broadcast_command(step)
        if any(command == Command.SHUTDOWN for command, _ in orders):
            return
        model.swap_ready()  # a step boundary: graphs compiled meanwhile run from this step on
        running.apply(orders)
        news = running.updates()  # a joiner's first token, or a row finished by its prompt pass
        running.step(propose_next)
        news.update(merge_updates(news, running.updates()))
        if report and (news or time.monotonic() - last_report >= 1.0):
            report(news)
            last_report = time.monotonic()


def merge_updates(before: dict[str, RowUpdate], after: dict[str, RowUpdate]) -> dict[str, RowUpdate]:
    """`after`, with the new tokens `before` held for the same request put first."""
    return {
        request_id: RowUpdate(
            before[request_id].new_tokens + update.new_tokens,
            update.finish_reason,
            update.metrics,
            before[request_id].new_logprobs + update.new_logprobs,
            update.cached_tokens,
            before[request_id].prompt_logprobs or update.prompt_logprobs,
            update.stop_token,
        )
        if request_id in before
        else update
        for request_id, update in after.items()
    }
