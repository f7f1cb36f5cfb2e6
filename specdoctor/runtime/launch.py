"""Starting rank processes: a free port for their process group, the fork server they start from, and
what Linux says of a process (stopped or running)."""

from __future__ import annotations

import multiprocessing as mp
import socket


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
    return context


def process_state(pid: int) -> str | None:
    """The one-letter state Linux reports for a process ('T' when stopped), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
