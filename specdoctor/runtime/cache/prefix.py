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
    """The chained hashes of the prompt's full blocks that end before its last token: the last token is always
    computed (its logits pick the first new token), and a drafter's entry there depends on that new token."""
    hashes, parent = [], b""
    for block in range((len(prompt) - 1) // BLOCK_SIZE):
        tokens = prompt[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little") for t in tokens)).digest()
        hashes.append(parent)
    return hashes


class PrefixStore:
    """Block hash -> {cache role ("target", "drafter"): [per layer, per entry: [BLOCK_SIZE, heads, width]]}."""

    def __init__(self, capacity_blocks: int = CAPACITY_TOKENS // BLOCK_SIZE):
        self.blocks: OrderedDict[bytes, dict[str, list[list[torch.Tensor]]]] = OrderedDict()
        self.capacity = capacity_blocks

    def hits(self, hashes: list[bytes]) -> int:
        """How many leading blocks are stored (each one found becomes the most recently used)."""
        count = 0
        for key in hashes:
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            count += 1
        return count

    def restore(self, caches: dict[str, KVCache], row: int, hashes: list[bytes], unwritten: str | None = None) -> None:
        """Write the stored entries of these blocks into the row's positions, in each cache of its role. The role
        `unwritten` gets what an engine's reused block holds where nothing wrote it: other blocks' entries (the
        least recently used ones', in order; --fault prefix-cache-drafter-kv)."""
        stale = list(self.blocks)
        for block, key in enumerate(hashes):
            span = slice(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
            for role, cache in caches.items():
                source = stale[block % len(stale)] if role == unwritten else key
                for buffers, stored in zip(cache.entries.values(), self.blocks[source][role], strict=True):
                    for buffer, value in zip(buffers, stored, strict=True):
                        buffer[row, span] = value

    def save(self, caches: dict[str, KVCache], row: int, hashes: list[bytes]) -> None:
        """Keep the row's entries for these blocks, from every cache at once (so every rank's store holds the
        same blocks whatever roles it keeps); a block kept already only becomes the most recently used."""
        for block, key in enumerate(hashes):
            if key not in self.blocks:
                span = slice(block * BLOCK_SIZE, (block + 1) * BLOCK_SIZE)
                self.blocks[key] = {
                    role: [[buffer[row, span].clone() for buffer in buffers] for buffers in cache.entries.values()]
                    for role, cache in caches.items()
                }
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
