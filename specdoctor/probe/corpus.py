"""Long prompts for the context sweep, cut from a text corpus the package ships: Python standard-library
modules (PSF licence), code with prose in its docstrings, gzipped. A prompt longer than the corpus wraps
around to its start (docs/probe.md §Context).

Prompt i of every length starts at the same place: the context sweep compares lengths prompt by prompt. (Ending
them at one place instead, the demo's acceptance fell with length from 68 % to 13 % at 1,308 tokens: its models
were trained on 128-token sequences, and what they write after a long context is what they never learned.)"""

from __future__ import annotations

import gzip
import random
from functools import cache
from importlib import resources

CORPUS = "python_stdlib.txt.gz"


@cache
def corpus_text() -> str:
    data = resources.files("specdoctor").joinpath("corpus", CORPUS).read_bytes()
    return gzip.decompress(data).decode("utf-8")


STARTS = 64  # the shares of the corpus prompts start in: the most prompts a context bucket sends (long prompts
# from one share would overlap)
GOLDEN = (5**0.5 - 1) / 2  # prompts past STARTS start this far on again in their share: the laps spread evenly
# A share's places lie in its first LAPS_SPAN, so that those of the next share, whatever their seed's offsets,
# start at least 1 - LAPS_SPAN of a share after its last (a share's laps lie 0.146 x LAPS_SPAN apart at 4 laps).
LAPS_SPAN = 0.85


def corpus_prompt(index: int, chars: int, seed: int = 0) -> str:
    """The `index`-th prompt of `chars` characters: the corpus from a line's start in the `index % STARTS`-th of
    STARTS shares, so prompts of one index differ only in how far they go on. A share's first prompt starts at
    its start, each later lap of the indices a golden-ratio step further round the share's first LAPS_SPAN (short
    prompts, such as the prefix-cache sweep's, then reach past STARTS without repeating). A `seed` (probe
    --prompt-seed) moves each share's places by an offset of its own, drawn apart for every share (so that seeds
    side by side do not give the same prompts); 0 keeps them where they always were."""
    text = corpus_text()
    share, lap = index % STARTS, index // STARTS
    shift = random.Random(f"{seed} {share}").random() if seed else 0.0
    place = share + LAPS_SPAN * ((shift + lap * GOLDEN) % 1)
    start = text.find("\n", int(len(text) * place / STARTS)) + 1
    laps = -(-(start + chars) // len(text))
    return (text * laps)[start : start + chars]
