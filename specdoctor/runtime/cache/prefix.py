"""Prefix caching as vLLM does it (`--enable-prefix-caching`, docs/runtime.md §Prefix caching): a prompt's
full blocks of BLOCK_SIZE tokens are hashed, each hash chained to the one before, and the K/V a rank computed
for them (its target layers', and on the drafter's rank the drafter's) is kept; a later prompt that starts
with the same blocks gets their K/V back and its prompt pass runs only past them.

Every rank keeps its own store and sees the same prompts in the same order, so every store makes the same
decisions (hits, insertions, evictions) without talking to the others.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch

from specdoctor.runtime.cache.kv_cache import KVCache

BLOCK_SIZE = 16  # vLLM's default block size
CAPACITY_TOKENS = 16384  # blocks kept at most, least recently used first out


def block_hashes(prompt: list[int]) -> list[bytes]:
    """The chained hashes of the prompt's full blocks that end before its last token (the last token is always
    computed: its logits pick the first new token). Each covers its block and the token after it, because a
    drafter's entry at a position reads the next token (MTP, EAGLE-3): the same block followed by another token
    holds other drafter entries."""
    hashes, parent = [], b""
    for block in range((len(prompt) - 1) // BLOCK_SIZE):
        tokens = prompt[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE + 1]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little") for t in tokens)).digest()
        hashes.append(parent)
    return hashes


class PrefixStore:
    """Block hash -> whether it holds drafter entries, and per cache role ("target", "drafter"; a rank keeps the
    roles it has) the entries: [per layer, per entry: [BLOCK_SIZE, heads, width]]."""

    def __init__(self, capacity_blocks: int = CAPACITY_TOKENS // BLOCK_SIZE):
        self.blocks: OrderedDict[bytes, tuple[bool, dict[str, list[list[torch.Tensor]]]]] = OrderedDict()
        self.capacity = capacity_blocks

    def hits(self, hashes: list[bytes], drafter: bool) -> int:
        """How many leading blocks are stored, with drafter entries where `drafter` (every rank knows whether a
        batch drafts, so every rank counts the same); each one found becomes the most recently used."""
        count = 0
        for key in hashes:
            if key not in self.blocks or (drafter and not self.blocks[key][0]):
                break
            self.blocks.move_to_end(key)
            count += 1
        return count

    def restore(self, caches: dict[str, KVCache], row: int, hashes: list[bytes], unwritten: str | None = None) -> None:
        """Write the stored entries of these blocks into the row's positions, in each cache of its role. The role
        `unwritten` gets what an engine's reused block holds where nothing wrote it: other blocks' entries (the
        least recently used ones', in order; --fault prefix-cache-drafter-kv)."""
        stale = [key for key, (drafter, _) in self.blocks.items() if drafter]
        for block, key in enumerate(hashes):
            span = slice(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
            for role, cache in caches.items():
                source = stale[block % len(stale)] if role == unwritten else key
                for buffers, stored in zip(cache.entries.values(), self.blocks[source][1][role], strict=True):
                    for buffer, value in zip(buffers, stored, strict=True):
                        buffer[row, span] = value

    def save(self, caches: dict[str, KVCache], row: int, hashes: list[bytes], drafter: bool) -> None:
        """Keep the row's entries for these blocks, from every cache at once (so every rank's store holds the
        same blocks whatever roles it keeps); a block kept already only becomes the most recently used, unless
        it lacks the drafter entries this batch has."""
        for block, key in enumerate(hashes):
            if key not in self.blocks or (drafter and not self.blocks[key][0]):
                span = slice(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
                entries = {
                    role: [[buffer[row, span].clone() for buffer in buffers] for buffers in cache.entries.values()]
                    for role, cache in caches.items()
                }
                self.blocks[key] = (drafter, entries)
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
