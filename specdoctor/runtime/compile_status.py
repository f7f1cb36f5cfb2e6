"""What a rank's compile thread reports (runtime/background_compile.py): how many graphs were asked for, finished,
swapped in. Free of torch, for the controller's side (progress, /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompileStatus:
    """One rank's graphs: asked for, finished (compiled, loaded, failed or taken by an earlier graph), active."""

    rank: int
    requested: int = 0
    finished: int = 0
    active: int = 0
    loaded: int = 0
    compiled: int = 0
    failed: int = 0
    seconds: float = 0.0  # spent compiling
    compiling: str = ""  # what the thread compiles now, for the progress
    warnings: list[str] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return self.requested - self.finished


def compile_totals(statuses: dict[int, CompileStatus]) -> dict[str, int]:
    """Every rank's graphs summed: asked for, finished, active, loaded, compiled, failed, pending."""
    names = ("requested", "finished", "active", "loaded", "compiled", "failed", "pending")
    return {name: sum(getattr(status, name) for status in statuses.values()) for name in names}
