"""Waiting for a state the tests can observe (a server's gauge, a process's state) instead of sleeping for a
guess: poll it, with a deadline, and fail saying what never happened and what was last seen."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(read: Callable[[], T], done: Callable[[T], bool], timeout_s: float, what: str, interval_s=0.05) -> T:
    """Poll `read()` until `done(value)`, at most `timeout_s` seconds; returns that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} (last seen: {value!r})")
        time.sleep(interval_s)


def process_state(pid: int) -> str | None:
    """The one-letter state Linux reports for `pid` ('T': stopped, 'Z': exited, not yet reaped); None once it
    is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running or stopped: neither gone nor a zombie."""
    return process_state(pid) not in (None, "Z")
