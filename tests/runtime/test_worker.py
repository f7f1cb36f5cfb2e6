"""A rank's command loop (runtime/worker.py `serve`), in this process on the demo: while it runs commands, what
the rank loaded is out of the garbage collector's reach (runtime/heap.py), so a full collection cannot stop a
step or a timed run for the 100-200 ms it took to walk the model's objects; thawed once the rank stops."""

from __future__ import annotations

import gc

from specdoctor.runtime.decode.requests import GenerateRequest, SequenceRequest
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.protocol import Command, ContinuousStart, Join, Order, Reply
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.runtime.worker import serve
from tests.helpers.heap import collector_walks

PROMPT = [1, 2, 3, 4, 5]


def test_a_rank_keeps_what_start_up_and_each_command_kept_out_of_full_collections():
    """A batch (`bench`, `check`, `serve`'s warm-up: the first ones compile), then continuous batching (`serve`):
    during each, the collector walks only what is new, not what the rank loaded nor what the batch before kept."""
    model, _ = load_rank(RuntimeOptions("demo", num_speculative_tokens=3), 0)
    stage = model.stage  # one of start-up's objects, alive for the whole run
    seen: dict[str, list[tuple[bool, ...]]] = {"generate": [], "continuous": []}
    kept_by_the_batch: list[list] = []  # made while the batch ran, alive after it
    orders = iter(
        [
            Order(Command.GENERATE, GenerateRequest([PROMPT], 4, num_speculative_tokens=3, stream=True)),  # every step
            Order(Command.CONTINUOUS, ContinuousStart(3, sampled_drafts=False, adaptive=False)),
            Order(Command.SHUTDOWN),
        ]
    )
    joins = iter([[Order(Command.JOIN, Join("0", SequenceRequest(PROMPT, 4)))], []])

    def walked(*objects) -> tuple[bool, ...]:
        made_now: list = []
        return (*(collector_walks(obj) for obj in objects), collector_walks(made_now))

    replies: dict[Reply, list] = {Reply.RESULT: [], Reply.UPDATES: []}

    def reply(what: Reply, payload) -> None:
        if what in (Reply.PARTIAL, Reply.RESULT):
            seen["generate"].append(walked(stage))
            kept_by_the_batch.append([])
        else:  # UPDATES
            seen["continuous"].append(walked(stage, kept_by_the_batch[0]))
        replies.setdefault(what, []).append(payload)

    def poll(idle: bool) -> list:
        seen["continuous"].append(walked(stage, kept_by_the_batch[0]))
        return next(joins, [Order(Command.SHUTDOWN)])

    serve(model, lambda: next(orders), reply, poll)
    assert len(seen["generate"]) >= 3 and all(step == (False, True) for step in seen["generate"])
    assert len(seen["continuous"]) >= 3 and all(step == (False, False, True) for step in seen["continuous"])
    assert gc.get_freeze_count() == 0 and collector_walks(stage)
    [result] = replies[Reply.RESULT]
    assert len(result.tokens[0]) == 4  # the batch ran to its limit
    assert sum(len(update.new_tokens) for step in replies[Reply.UPDATES] for update in step.values()) >= 1  # it served
