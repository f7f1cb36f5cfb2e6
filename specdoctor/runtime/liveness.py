"""Waiting for peers that are working, not timing them out: `--timeout` bounds a peer that is stuck.

A rank that loads its weights, times its kernels or compiles can take minutes, longer on a busy machine, and a peer
that meets it in a collective would give up after the process group's timeout. So a rank does long work inside
`working(phase)`, which beats (a counter and the phase, in the process group's store) once a second, and ranks meet
after such work at `wait_for_peers`, which waits as long as every peer it waits for is beating or has arrived: a peer
whose beat stops for `timeout_s` (stopped by a signal or a debugger, or gone) is named, with what it was doing.
"""

from __future__ import annotations

import contextlib
import threading
import time

BEAT_S = 1.0  # a working rank's beat
POLL_S = 0.1  # how often a waiting rank looks


class PeerStuck(Exception):
    """A peer's beat stopped while this rank waited for it."""


class Liveness:
    """`store`: the process group's key-value store (None: a rank alone, which waits for no one)."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.beats, self.phase, self.meetings = 0, "starting", 0
        self.lock = threading.Lock()
        self._beat()

    @contextlib.contextmanager
    def working(self, phase: str):
        """Beat as `phase` while the block runs (from a thread: the block need not call back)."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(BEAT_S):
                self._beat()

        previous, self.phase = self.phase, phase
        self._beat()
        beater = threading.Thread(target=beat, name="specdoctor-beat", daemon=True)
        beater.start()
        try:
            yield
        finally:
            done.set()
            beater.join()
            self.phase = previous

    def wait_for_peers(self, what: str) -> None:
        """Until every rank of the group has called this (the n-th call meets every rank's n-th); raises PeerStuck
        naming a rank whose beat stopped for `timeout_s` before it came."""
        if self.store is None or self.world_size == 1:
            return
        self.meetings += 1
        meeting = f"specdoctor/met/{self.meetings}/"
        self.store.set(f"{meeting}{self.rank}", what)
        waiting = set(range(self.world_size)) - {self.rank}
        last_seen = {peer: (self._peer_beat(peer), time.monotonic()) for peer in waiting}
        while waiting:
            time.sleep(POLL_S)
            for peer in sorted(waiting):
                if self.store.check([f"{meeting}{peer}"]):
                    waiting.discard(peer)
                    continue
                beat, since = last_seen[peer]
                now_beat = self._peer_beat(peer)
                if now_beat != beat:
                    last_seen[peer] = (now_beat, time.monotonic())
                elif time.monotonic() - since > self.timeout_s:
                    doing = beat.split("|", 1)[1] if "|" in beat else "starting"
                    raise PeerStuck(
                        f"rank {peer} made no progress for {time.monotonic() - since:.0f} s while {doing}, waited for "
                        f"{what} (stopped or hung: --timeout {self.timeout_s:g} s)"
                    )

    def _beat(self) -> None:
        if self.store is None:
            return
        with self.lock:
            self.beats += 1
            self.store.set(f"specdoctor/beat/{self.rank}", f"{self.beats}|{self.phase}")

    def _peer_beat(self, peer: int) -> str:
        key = f"specdoctor/beat/{peer}"
        return self.store.get(key).decode() if self.store.check([key]) else ""
