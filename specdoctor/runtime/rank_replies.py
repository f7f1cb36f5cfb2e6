"""What the ranks send the controller, each on its own pipe, and what their silence or death means."""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.process import BaseProcess

from specdoctor.errors import PipelineError
from specdoctor.runtime.compile_status import CompileStatus
from specdoctor.runtime.launch import process_state
from specdoctor.runtime.protocol import RankReply, Reply

# What a failing rank reports: its own failure, or a failure talking to a peer (a consequence).
ERRORS = (Reply.ERROR, Reply.PEER_ERROR)


class RankReplies:
    """One reply pipe per rank: a shared queue has a cross-process lock, and a rank stopped while holding it would
    block every other rank's replies, error reports included. A failure the replies tell of, or a rank's death or
    silence, raises PipelineError naming its root cause."""

    def __init__(
        self,
        pipes: list[Connection],
        processes: list[BaseProcess],
        on_compile_status: Callable[[int, CompileStatus], None],
    ):
        self._pipes, self._processes, self._on_compile_status = list(pipes), processes, on_compile_status

    def wait_for(self, wanted: Reply, silence_limit_s: float | None, on_partial=None) -> RankReply:
        """The next `wanted` reply; PARTIAL ones go to `on_partial`, COMPILE_STATUS ones to `on_compile_status`."""
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
            if message.reply == Reply.COMPILE_STATUS:
                self._on_compile_status(message.rank, message.payload)
                continue
            if message.reply in ERRORS:
                time.sleep(0.5)  # let a peer's death and its own report arrive, so the root cause is named
                own = [message.payload] if message.reply == Reply.ERROR else []
                reported = self._root_cause(own, [message.payload])
                self._raise_if_a_rank_died(reported=reported)
                raise PipelineError(reported)
            if message.reply == wanted:
                return message
            if message.reply == Reply.PARTIAL and on_partial:
                on_partial(message.payload)

    def _next_reply(self, timeout: float) -> RankReply | None:
        """The next reply any rank sent, or None when none came within `timeout`."""
        for pipe in wait_for_any(self._pipes, timeout):
            try:
                return pipe.recv()
            except EOFError:  # the rank exited; its exit code says how
                self._pipes.remove(pipe)
        return None

    def _raise_if_a_rank_died(self, reported: str | None = None) -> None:
        dead = [(rank, p.exitcode) for rank, p in enumerate(self._processes) if p.exitcode is not None]
        if not dead:
            return
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
            if message.reply in ERRORS:
                (own if message.reply == Reply.ERROR else consequences).append(message.payload)
        return (own or consequences or [None])[0]

    def _raise_silent_pipeline(self, silent_for: float) -> None:
        processes = self._processes
        stopped = [rank for rank, process in enumerate(processes) if process_state(process.pid) in ("T", "t")]
        if stopped:
            who = ", ".join(f"rank {rank} (pid {processes[rank].pid})" for rank in stopped)
            raise PipelineError(f"pipeline {who} stopped (SIGSTOP or a debugger): no reply for {silent_for:.0f} s")
        pids = ", ".join(str(process.pid) for process in processes)
        raise PipelineError(f"no reply from the pipeline for {silent_for:.0f} s; its ranks (pids {pids}) are alive")
