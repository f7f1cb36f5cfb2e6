"""One pipeline rank: load the tensors it owns, then run the orders the first rank broadcasts (runtime/protocol.py)."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

from specdoctor.errors import PipelineError, SpecdoctorError
from specdoctor.runtime.decode.batch import decode_batch
from specdoctor.runtime.decode.continuous import run_continuous
from specdoctor.runtime.decode.pipeline import RankModel, prompt_logits
from specdoctor.runtime.drafter.measure import combine_states, measure_drafter
from specdoctor.runtime.drafter.repair import combine_repairs, repair_drafter
from specdoctor.runtime.heap import freeze_survivors, frozen_startup_heap
from specdoctor.runtime.launch import kill_descendants
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.protocol import Command, Order, RankReply, Reply
from specdoctor.runtime.rank_loading import load_rank
from specdoctor.runtime.rank_process import prepare_rank_process
from specdoctor.runtime.tap_probe import probe_taps

# Operations only the drafter's stage answers: what the live drafter holds, and its repair; each TP rank's
# answer about its shard, combined into one.
DRAFTER_OPERATIONS = {
    Command.MEASURE_DRAFTER: (measure_drafter, combine_states, Reply.DRAFTER_STATE),
    Command.REPAIR_DRAFTER: (repair_drafter, combine_repairs, Reply.REPAIRED),
}

SendReply = Callable[[Reply, object], None]


class StepReporter:
    """The first rank's per-step callback: the tokens so far when streaming, else a beat at most once a
    second, so the controller's silence deadline catches stalls but not long generations."""

    def __init__(self, reply: SendReply, stream: bool):
        self.reply, self.stream, self.last_beat = reply, stream, time.monotonic()

    def __call__(self, result) -> None:
        if self.stream:
            self.reply(Reply.PARTIAL, result.tokens)
        elif time.monotonic() - self.last_beat >= 1.0:
            self.reply(Reply.ALIVE, None)
            self.last_beat = time.monotonic()


def serve(
    model: RankModel,
    next_order: Callable[[], Order] | None,
    reply: SendReply,
    poll: Callable[[bool], list[Order]] | None = None,
) -> None:
    """Run broadcast orders until SHUTDOWN. Only the first rank has `next_order` and, for continuous batching,
    `poll` (see runtime/decode/continuous.py). TP rank 0 of a stage speaks for it: the others compute alike and
    stay silent, but for the drafter's operations, whose answers differ per shard."""
    speaks = model.comm.tp_rank == 0
    first, last = model.placement.is_first and speaks, model.placement.is_last and speaks
    # The loaded model, then what each order kept (the first ones compile the graphs): no full collection walks
    # them in the middle of a step or a timed run.
    with frozen_startup_heap():
        while True:
            command, payload = model.comm.broadcast_command(next_order() if next_order else None)
            if command == Command.SHUTDOWN:
                return
            if command == Command.CONTINUOUS:  # serves until shutdown
                report = (lambda news: reply(Reply.UPDATES, news)) if last else None
                run_continuous(model, payload, poll, report)
                return
            run_command(model, command, payload, reply, first, last)
            # After the reply, so the rank's own times leave it out; a controller's next order waits for it,
            # but it walks only what this order kept, not the frozen heap.
            freeze_survivors()


def run_command(model: RankModel, command: Command, payload, reply: SendReply, first: bool, last: bool) -> None:
    """One order of `serve`'s loop, in a function of its own: its results are gone when the loop freezes what
    survived it."""
    if command == Command.GENERATE:
        result = decode_batch(model, payload, on_step=StepReporter(reply, payload.stream) if first else None)
        if first:
            reply(Reply.RESULT, result)
    elif command == Command.SCORE:
        logits = prompt_logits(model, payload)
        if last:
            reply(Reply.LOGITS, logits)
    elif command == Command.PROBE_TAPS:  # every rank takes part; the drafter's rank answers
        readings = probe_taps(model, payload)
        if last:
            reply(Reply.TAP_READINGS, readings)
    elif command == Command.FINISH_COMPILES:
        model.finish_compiles(beat=lambda: reply(Reply.ALIVE, None))
        if first:
            reply(Reply.COMPILES_FINISHED, None)
    elif command in DRAFTER_OPERATIONS and model.placement.is_last:
        operation, combine, answer = DRAFTER_OPERATIONS[command]
        answers = model.comm.gather_tp(operation(model, **payload), command.value)
        if last:
            reply(answer, combine(answers))


class ControllerGone(Exception):
    """The controller's end of this rank's reply pipe is closed: it was stopped."""


def rank_main(
    options: RuntimeOptions, rank: int, port: int, inbox, replies, environment: dict[str, str], host_cores: int
) -> None:
    """Entry point of a rank process started by `Engine`; `replies` is this rank's own pipe to the controller.
    `environment`: the controller's, as it was when the engine started (the fork server's is older)."""
    prepare_rank_process(options, port, environment, host_cores)
    model = None
    parent = os.getppid()

    def next_order(timeout: float = min(options.timeout / 4, 2.0)) -> Order:
        # Idle ranks wait inside a collective; a heartbeat keeps them under its timeout and
        # notices a dead peer even when no request is in flight.
        try:
            return inbox.get(timeout=timeout)
        except queue.Empty:
            # A controller killed without closing the engine leaves no one to send SHUTDOWN.
            return Order(Command.SHUTDOWN if os.getppid() != parent else Command.HEARTBEAT)

    def poll(idle: bool) -> list[Order]:
        """What the controller queued since the last step; an idle batch waits (briefly) for something."""
        orders = [next_order(0.5)] if idle else []
        while True:
            try:
                orders.append(inbox.get_nowait())
            except queue.Empty:
                return [order for order in orders if order.command != Command.HEARTBEAT]

    sending = threading.Lock()  # the compile thread reports on the same pipe

    def reply(what: Reply, payload) -> None:
        try:
            with sending:
                replies.send(RankReply(what, rank, payload))
        except (BrokenPipeError, ConnectionResetError):  # the controller stopped while this rank worked
            raise ControllerGone from None

    def report(what: Reply, payload) -> None:
        with contextlib.suppress(ControllerGone):  # no one left to tell
            reply(what, payload)

    try:
        model, info = load_rank(options, rank)
        reply(Reply.READY, {**info, "threads": torch.get_num_threads()})
        if model.graphs is not None:
            model.graphs.report_to(lambda status: report(Reply.COMPILE_STATUS, status))
        first = rank == 0
        serve(model, next_order if first else None, reply, poll if first else None)
    except ControllerGone:  # stopped by a signal (the controller ends at once): nothing to say
        raise SystemExit(1) from None
    except PipelineError as err:  # a peer failed or hung: the peer's own report names the cause
        report(Reply.PEER_ERROR, str(err))
        raise SystemExit(1) from None
    except SpecdoctorError as err:
        report(Reply.ERROR, str(err))
        raise SystemExit(1) from None
    except Exception as err:  # an unexpected failure: keep the traceback for whoever reads the logs
        report(Reply.ERROR, f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
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
