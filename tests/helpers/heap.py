"""Whether Python's garbage collector walks an object: serving freezes the start-up heap while it serves
(runtime/heap.py), and a full collection then walks only what was allocated since."""

from __future__ import annotations

import gc


def collector_walks(obj) -> bool:
    return any(tracked is obj for tracked in gc.get_objects())
