"""A rank process's own settings, made before it loads: its signals and environment, its threads, how it keeps
freed memory, and no progress lock shared with other processes."""

from __future__ import annotations

import ctypes
import os
import signal

import torch

from specdoctor.runtime.options import RuntimeOptions


def prepare_rank_process(options: RuntimeOptions, port: int, environment: dict[str, str], host_cores: int) -> None:
    """`environment`: the controller's, as it was when the engine started (the fork server's is older)."""
    # Ctrl-C reaches every process of the terminal's group: the controller stops the ranks, so a rank
    # interrupted on its own would only print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(rank_threads(options.pp * options.tp, host_cores))
    keep_freed_memory_mapped()
    no_shared_progress_lock()


def keep_freed_memory_mapped() -> None:
    """glibc hands every freed block over 128 KiB back to the kernel and page-faults it in again on
    the next allocation; a decode step makes such blocks dozens of times (gathered expert weights,
    logits), so raise that threshold, as jemalloc or tcmalloc would behave. No-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD


def no_shared_progress_lock() -> None:
    """Inductor's compile shows tqdm bars, and tqdm makes a cross-process lock for them on first use: a rank that
    ends without Python's exit handlers (os._exit below, or stopped by a signal) leaves that lock behind and the
    controller's resource tracker warns of a leak at exit. A rank's bars share no lock with other processes."""
    try:
        from tqdm.std import TqdmDefaultWriteLock
    except ImportError:
        return
    TqdmDefaultWriteLock.mp_lock = None


def rank_threads(ranks: int, host_cores: int) -> int:
    """Each rank's intra-op threads: the machine's cores, less `host_cores` left to the controller's own work
    (`serve`'s HTTP front; vLLM's CPU backend keeps one per worker for its scheduler), shared by the ranks."""
    return max(1, ((os.cpu_count() or 1) - host_cores) // ranks)
