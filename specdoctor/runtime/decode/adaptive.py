"""Serving's choice between a speculative step and a plain one, from what each has yielded while serving.

A speculative step costs a verify pass over k + 1 tokens a row and the drafter's chain; a plain step one token a
row and a fill of the drafter's cache. Which yields more tokens a second depends on the batch's rows, the machine
and the acceptance the requests see, so it is measured, per range of rows, on the steps the server runs:
docs/commands.md, "Adaptive speculation".
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque

from specdoctor.runtime.options import FEWEST_PLAIN_ROWS

MEASURED_STEPS = 4  # steps of a kind at a range of rows before their rates decide
RETRY_EVERY = 64  # steps at a range of rows after which the losing kind is measured again
KEPT_STEPS = 8  # the latest steps of a kind at a range whose median rate is its rate


def rows_range(rows: int) -> int:
    """Ranges of rows measured apart: 1, 2-3, 4-7, 8-15, ..."""
    return max(rows, 1).bit_length()


class SpeculationPolicy:
    """Tokens a second of each kind of step (speculative, plain) per range of rows, the median of its latest
    KEPT_STEPS steps there (a median: the first step of a kind at a size runs slower; steps that switch kinds are not
    observed); the next step takes the kind with more, after each has been measured there (the unmeasured kind is
    tried first), and the losing kind is tried again every RETRY_EVERY steps, since acceptance moves with the
    requests."""

    def __init__(self):
        self.recent: dict[tuple[bool, int], deque[float]] = defaultdict(lambda: deque(maxlen=KEPT_STEPS))
        self.measured: dict[tuple[bool, int], int] = defaultdict(int)
        self.since_retry: dict[int, int] = defaultdict(int)

    def observe(self, speculated: bool, rows: int, tokens: int, seconds: float) -> None:
        key = (speculated, rows_range(rows))
        self.recent[key].append(tokens / max(seconds, 1e-9))
        self.measured[key] += 1

    def rate(self, speculated: bool, where: int) -> float:
        return statistics.median(self.recent[speculated, where])

    def speculate(self, rows: int) -> bool:
        """Whether the next step of a batch of `rows` rows speculates."""
        if rows < FEWEST_PLAIN_ROWS:
            return True
        where = rows_range(rows)
        for kind in (True, False):
            if self.measured[kind, where] < MEASURED_STEPS:
                return kind
        better = self.rate(True, where) >= self.rate(False, where)
        self.since_retry[where] += 1
        if self.since_retry[where] >= RETRY_EVERY:
            self.since_retry[where] = 0
            self.measured[not better, where] = MEASURED_STEPS - 1  # one more step of it refreshes its average
            return not better
        return better
