"""What the controller (runtime/engine.py) and the ranks (runtime/worker.py) say to each other.

The controller queues `Order`s for the first rank, which broadcasts each to every rank (runtime/comm.py); a rank
answers on its own pipe with `RankReply`s. Both travel pickled, as they are. During continuous batching
(runtime/decode/continuous.py) the orders are JOIN, CANCEL and SHUTDOWN, broadcast once per step.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class Command(Enum):
    """What the controller asks of the ranks; each comment names the payload and the answer."""

    GENERATE = "generate"  # GenerateRequest; RESULT, with PARTIAL or ALIVE while it runs
    SCORE = "score"  # prompts; LOGITS
    PROBE_TAPS = "probe_taps"  # a prompt; TAP_READINGS
    FINISH_COMPILES = "finish_compiles"  # None; COMPILES_FINISHED, with ALIVE while it waits
    MEASURE_DRAFTER = "measure_drafter"  # {}; DRAFTER_STATE
    REPAIR_DRAFTER = "repair_drafter"  # {"names": broken tensors by TP rank}; REPAIRED
    CONTINUOUS = "continuous"  # ContinuousStart; UPDATES every step until SHUTDOWN
    JOIN = "join"  # Join, during continuous batching
    CANCEL = "cancel"  # a request id, during continuous batching
    HEARTBEAT = "heartbeat"  # None: nothing queued, broadcast so idle ranks' collectives stay under their timeout
    SHUTDOWN = "shutdown"  # None


class Reply(Enum):
    """What a rank tells the controller."""

    READY = "ready"  # the rank's info (placement, keys read, threads)
    RESULT = "result"
    PARTIAL = "partial"  # the tokens so far, when streaming
    ALIVE = "alive"  # a beat during a long command, so the controller's silence deadline spares it
    LOGITS = "logits"
    TAP_READINGS = "tap_readings"
    COMPILES_FINISHED = "compiles_finished"
    DRAFTER_STATE = "drafter_state"
    REPAIRED = "repaired"
    UPDATES = "updates"  # a step's RowUpdates by request id (empty: a beat)
    COMPILE_STATUS = "compile_status"  # the rank's graphs, whenever its compile thread has news
    ERROR = "error"  # the rank's own failure
    PEER_ERROR = "peer_error"  # a failure talking to a peer: a consequence of another rank's


class Order(NamedTuple):
    command: Command
    payload: object = None


class RankReply(NamedTuple):
    reply: Reply
    rank: int
    payload: object = None


class ContinuousStart(NamedTuple):
    k: int  # speculative tokens
    sampled_drafts: bool
    adaptive: bool  # adaptive speculation (runtime/decode/adaptive.py)


class Join(NamedTuple):
    request_id: str
    sequence: object  # a SequenceRequest (runtime/decode/requests.py; not imported: this module imports nothing)
