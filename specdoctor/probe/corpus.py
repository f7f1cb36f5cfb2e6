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


STARTS = 64  # the places prompts start at, spread over the corpus: the most prompts a sweep sends of one length


def corpus_prompt(index: int, chars: int, seed: int = 0) -> str:
    """The `index`-th prompt of `chars` characters: the corpus from the `index`-th of STARTS places (a line's
    start), so prompts of one index differ only in how far they go on. A `seed` (probe --prompt-seed) moves each
    place to a random line of its share of the corpus, drawn apart for every index (so that seeds side by side do
    not give the same prompts); 0 keeps them where they always were."""
    text = corpus_text()
    shift = random.Random(f"{seed} {index % STARTS}").random() if seed else 0.0
    start = text.find("\n", int(len(text) * ((index % STARTS) + shift) / STARTS)) + 1
    laps = -(-(start + chars) // len(text))
    return (text * laps)[start : start + chars]
