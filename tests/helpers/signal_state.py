"""What Linux says of a process's signals, for a test whose signal went unanswered: pending, blocked (per thread),
ignored and caught, as /proc shows them, so the failure says which of them swallowed it."""

from __future__ import annotations

import signal
from pathlib import Path

FIELDS = ("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")


def signal_state(pid: int) -> str:
    """One line per thread of `pid`: its state and signal masks (hex, bit n-1 for signal n; SIGINT is bit 1)."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*"), key=lambda path: int(path.name)):
        try:
            status = dict(line.split(":\t", 1) for line in (task / "status").read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        fields = " ".join(f"{name}={status.get(name, '?').strip()}" for name in FIELDS)
        lines.append(f"thread {task.name} ({status.get('Name', '?').strip()}): {fields}")
    return "\n".join(lines) or f"process {pid} is gone"


def as_a_terminal_starts_it() -> None:
    """`preexec_fn` for a process a test sends Ctrl-C: SIGINT's default disposition, as a terminal's child has it.
    A test run started in the background (`cmd &` in a script, `nohup`) inherits SIGINT ignored, which a child keeps
    across exec and Python honours: its Ctrl-C would be lost for a reason that is not the code's."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
