"""Python's garbage collector in long-running processes: `serve`'s server process, and every rank.

A full (oldest-generation) collection walks every object the collector tracks. After torch, the model and its
compiled graphs are loaded that is hundreds of thousands of objects, and such a pass stopped a serving process
for 100-200 ms at a time on a 2-core machine, in the middle of requests (docs/runtime.md: a rank's heap), and
could fall inside a step that `bench` times. Objects built at start-up live as long as the process, so they are frozen
while it serves or runs commands: collections then walk only what that work allocates. vLLM does the same
(`freeze_gc_heap` after start-up, `gc.unfreeze` at shutdown).
"""

from __future__ import annotations

import contextlib
import gc


def freeze_survivors() -> None:
    """Collect what is unreachable now, then move every surviving object out of the collector's reach (cumulative:
    what an earlier call froze stays frozen)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen_startup_heap():
    """Freeze what start-up built (`freeze_survivors`) until the block ends; a long-running loop inside calls
    `freeze_survivors` again once its own start-up work (a warm-up's compiled graphs) is done. Thawed after: an
    interpreter that exits (or a test that goes on) frees them again, and extensions that count their live objects
    at exit (Triton's) find none left over."""
    freeze_survivors()
    try:
        yield
    finally:
        gc.unfreeze()
