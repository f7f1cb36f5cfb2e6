"""The background compile as the ranks report it (runtime/background_compile.py): a progress bar while graphs are on
their way, a line when they are all in, and each warning once."""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specdoctor.runtime.compile_status import CompileStatus, compile_totals


class CompileProgress:
    """`update` is the engine's `on_compile_status` (called from whichever thread reads the ranks' replies)."""

    def __init__(self, console: Console):
        self.console = console
        self.progress: Progress | None = None
        self.task = None
        self.started = time.perf_counter()
        self.warned: set[str] = set()
        self.lock = threading.Lock()

    def update(self, statuses: dict[int, CompileStatus]) -> None:
        with self.lock:
            for status in statuses.values():
                for warning in status.warnings:
                    if warning not in self.warned:
                        self.warned.add(warning)
                        self.console.print(f"[yellow]warning[/yellow] rank {status.rank}: {warning}", highlight=False)
            totals = compile_totals(statuses)
            compiling = [f"rank {s.rank}: {s.compiling}" for s in statuses.values() if s.compiling]
            if totals["pending"] and self.progress is None:
                self._start()
            if self.progress is not None:
                description = f"compiling behind serving ({', '.join(compiling) or 'loading'})"
                self.progress.update(
                    self.task, total=totals["requested"], completed=totals["finished"], description=description
                )
                if not totals["pending"]:
                    self._stop(totals)

    def _start(self) -> None:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self.progress = Progress(*columns, console=self.console, transient=True)
        self.task = self.progress.add_task("compiling behind serving", total=None)
        self.progress.start()

    def _stop(self, totals: dict[str, int]) -> None:
        self.progress.stop()
        self.progress = None
        self.console.print(
            f"graphs ready: {totals['loaded']} loaded from the compile cache, {totals['compiled']} compiled "
            f"({time.perf_counter() - self.started:.0f} s since start-up)"
            + (f", {totals['failed']} failed (those passes run eager)" if totals["failed"] else ""),
            highlight=False,
        )
