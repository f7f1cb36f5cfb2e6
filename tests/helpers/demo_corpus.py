"""The demo model's text: the Python standard library's sources, split into train and held-out
by a hash of each file's path (so the split is the same on every machine with the same Python)."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer

HELD_OUT_BUCKETS = 13  # of 256: about 5 % of files are never trained on


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    held_out = [p for p in files if hashlib.sha256(str(p.relative_to(root)).encode()).digest()[0] < HELD_OUT_BUCKETS]
    return [p for p in files if p not in held_out], held_out


def read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def held_out_prompts(tokenizer: Tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    eos = tokenizer.token_to_id("<|endoftext|>")
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(read_texts(corpus_files()[1])):
        stream += encoding.ids + [eos]
    offsets = torch.randint(0, len(stream) - length, (count,), generator=torch.Generator().manual_seed(seed))
    return [stream[o : o + length] for o in offsets.tolist()]
