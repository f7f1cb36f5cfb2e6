"""How varied a drafter's proposals are, and when one token among them says the drafter ignores its context."""

from __future__ import annotations

import math
from collections import Counter

CONSTANT_PROPOSALS_MIN_COUNT = 20  # drafts needed before their spread means anything
CONSTANT_PROPOSALS_SHARE = 0.5  # one token in half of the drafts: the drafter ignores its context


def proposal_profile(proposals: list[int]) -> dict:
    """How varied the drafter's proposals are: share of the most frequent token and entropy in bits."""
    if not proposals:
        return {"count": 0, "top_token": None, "top_share": 0.0, "entropy_bits": 0.0}
    counts = Counter(proposals)
    token, top = counts.most_common(1)[0]
    total = len(proposals)
    entropy = 0.0 - sum(n / total * math.log2(n / total) for n in counts.values())  # never -0.0
    return {"count": total, "top_token": token, "top_share": top / total, "entropy_bits": entropy}
