"""How long the probe gives each request: what the server's own pace needs, measured from its replies, inside the
probe's one budget (`--timeout`). A slow but healthy server (a loaded machine, a cold compile) is waited for; a
request that takes several times what every earlier one took is cut off, and the budget bounds them all."""

from __future__ import annotations

import threading
import time

from specdoctor.errors import SpecdoctorError

# A request may take this many times what the slowest pace seen so far predicts for its tokens.
SAFETY = 4.0


class BudgetSpent(SpecdoctorError):
    """The probe's whole budget (--timeout) ran out: the sweep under way and the ones after it are not run."""


class Pace:
    """`floor_s`: the least a request is given (--request-timeout); `budget_s`: the probe's whole budget, from now."""

    def __init__(self, floor_s: float, budget_s: float, deadline: float | None = None):
        self.floor_s, self.budget_s = floor_s, budget_s
        self.deadline = deadline or time.monotonic() + budget_s
        self.observed: dict[int, float] = {}  # requests in flight -> the slowest seconds per token seen there
        self.lock = threading.Lock()

    def left(self) -> float:
        """Seconds left of the budget; BudgetSpent when none are."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise BudgetSpent(f"the probe ran past its {self.budget_s:.0f} s budget (--timeout)")
        return left

    def timeout(self, tokens: int, in_flight: int) -> float:
        """Seconds for a request of `tokens` tokens sent with `in_flight` requests in flight (itself included): SAFETY
        times the pace seen at the most requests in flight up to these (the slowest seen there), taken as linear in
        the requests in flight beyond it (a server that batches them does better), at least `floor_s`; before any
        reply, what is left of the budget."""
        left = self.left()
        with self.lock:
            observed = dict(self.observed)
        if not observed:
            return left
        below = [seen_at for seen_at in observed if seen_at <= in_flight]
        if below:
            pace = observed[max(below)] * in_flight / max(below)
        else:  # seen only with more in flight: at most as slow
            pace = observed[min(observed)]
        return min(left, max(self.floor_s, SAFETY * pace * (tokens + 1)))

    def observe(self, seconds: float, tokens: int, in_flight: int) -> None:
        """A reply of `tokens` completion tokens that took `seconds` with `in_flight` requests in flight."""
        pace = seconds / (tokens + 1)  # the prompt's pass counts as one more
        with self.lock:
            self.observed[in_flight] = max(pace, self.observed.get(in_flight, 0.0))
