"""Long prompts for the context sweep, cut from a text corpus the package ships: Python standard-library
modules (PSF licence), code with prose in its docstrings, gzipped. A prompt longer than the corpus wraps
around to its start (docs/probe.md §Context)."""

from __future__ import annotations

import gzip
from functools import cache
from importlib import resources

CORPUS = "python_stdlib.txt.gz"


@cache
def corpus_text() -> str:
    data = resources.files("specdoctor").joinpath("corpus", CORPUS).read_bytes()
    return gzip.decompress(data).decode("utf-8")


def corpus_prompt(index: int, count: int, chars: int) -> str:
    """The `index`-th of `count` prompts of `chars` characters, each from its own stretch of the corpus
    (starting at a line), so prompts of one length are different texts."""
    text = corpus_text()
    start = text.find("\n", len(text) * index // max(count, 1)) + 1
    repeats = -(-(start + chars) // len(text))
    return (text * repeats)[start : start + chars]
