"""Starting rank processes: a free port for their process group, the fork server they start from, and
what Linux says of a process (stopped or running)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import threading


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_context():
    """Ranks fork from a server process that has imported the runtime (torch included) once: a rank then
    starts in a fraction of a second instead of importing it all again, as a spawned one would. The server
    never touches a device, so forking from it is as safe as spawning; it ends with this process."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["specdoctor.runtime.fork_preload"])
    start_fork_server()
    return context


def start_fork_server() -> None:
    """Started with SIGINT blocked, which a new process inherits: Ctrl-C reaches the terminal's whole process
    group, and the fork server, importing the runtime for seconds, would otherwise print a traceback (once
    imported it ignores SIGINT; its ranks do too: the controller stops them). Blocked, not ignored, here: a Ctrl-C
    in the moment it takes to launch stays pending and is raised once launched, not lost."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # first: launching it unblocks SIGINT, which the fork server would inherit
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def process_state(pid: int) -> str | None:
    """The one-letter state Linux reports for a process ('T' when stopped), or None where unknown."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def stat_fields(pid: int) -> list[str]:
    """What Linux reports of a process after its name (state, parent pid, ...); [] where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def kill_descendants(pid: int) -> None:
    """SIGKILL every process `pid` started, and theirs (a rank's compilers: a rank that is stopped or exits would leave
    them compiling on as orphans). Linux only; elsewhere nothing."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return
    children: dict[int, list[int]] = {}
    for child in pids:
        fields = stat_fields(child)
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(child)
    found, pending = [], list(children.get(pid, []))
    while pending:
        child = pending.pop()
        found.append(child)
        pending += children.get(child, [])
    for child in found:
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)


@contextlib.contextmanager
def stop_signals_held():
    """Ctrl-C or SIGTERM while a rank process is being made would leave it half-made: its pid not yet known to
    this process (so never stopped), it fails reading its arguments once this process is gone and prints a
    traceback. Caught here (masking would not do: another thread takes the signal for the interpreter), they are
    raised again once every rank has started, and stopping then stops them all."""
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {signum: signal.getsignal(signum) for signum in stops}
    # Only the main thread sets handlers; one installed outside Python (None) could not be put back.
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield
        return
    caught: list[int] = []
    try:
        for signum in stops:  # the holding handler only records, so nothing raises while handlers change
            signal.signal(signum, lambda number, _frame: caught.append(number))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in caught[:1]:
            signal.raise_signal(signum)
