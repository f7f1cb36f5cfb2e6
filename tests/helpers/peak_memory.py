"""Run a command and sample the resident memory of it and every process it starts (its pipeline ranks, their
fork server), summed, every 0.1 s: the peak a machine must hold. Shared pages count once per process, so
the sum is an upper bound."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int
    seconds: float


def process_tree(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, grown = {root}, True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grown = bool(children)
    return tree


def resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def run_measured(command: list[str], timeout_s: float, env: dict | None = None) -> Run:
    """The command's exit code and output, its process tree's peak resident memory, and its wall time. The
    output goes to files while it runs (a pipe nobody reads would fill and stop the command)."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env)
        peak, deadline = 0, start + timeout_s
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                raise TimeoutError(f"{' '.join(command)} ran past {timeout_s} s")
            peak = max(peak, sum(resident_bytes(pid) for pid in process_tree(process.pid)))
            time.sleep(0.1)
        stdout.seek(0)
        stderr.seek(0)
        return Run(process.returncode, stdout.read(), stderr.read(), peak, time.monotonic() - start)
