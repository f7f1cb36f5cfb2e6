"""Python's garbage collector in a long-running server process.

A full (oldest-generation) collection walks every object the collector tracks. After torch, the model and its
compiled graphs are loaded that is hundreds of thousands of objects, and such a pass stopped a serving process
for 100-200 ms at a time on a 2-core machine, in the middle of requests (docs/performance.md: pauses). Objects
built at start-up live as long as the process, so they are frozen while it serves: collections then walk only
what serving itself allocates. vLLM does the same (`freeze_gc_heap` after start-up, `gc.unfreeze` at shutdown).
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def frozen_startup_heap():
    """Collect what start-up left unreachable (the warm-up's batches), then move every surviving object out of the
    collector's reach until the block ends. Thawed after: an interpreter that exits (or a test that goes on) frees
    them again, and extensions that count their live objects at exit (Triton's) find none left over."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
