"""Prefix caching's block store: which blocks a prompt finds, and that every rank's store decides alike."""

from __future__ import annotations

import torch

from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.cache.prefix import BLOCK_SIZE, PrefixStore, block_hashes


def cache_with(value: float) -> KVCache:
    cache = KVCache([0], 1, 64, ((1, 2),), torch.float32, "cpu")
    cache.entries[0][0].fill_(value)
    return cache


def test_a_block_is_found_only_with_the_token_after_it():
    """A drafter's entry at a position reads the next token: a prompt that shares two blocks but not the token
    after them finds one block, not two."""
    prompt = list(range(40))
    other = [*prompt[:32], 999, *prompt[33:]]
    store = PrefixStore()
    store.save({"target": cache_with(1.0)}, 0, block_hashes(prompt), drafter=False)
    assert store.hits(block_hashes(prompt), drafter=False) == 2
    assert store.hits(block_hashes(other), drafter=False) == 1
    assert (
        len(block_hashes(list(range(33)))) == 2 and len(block_hashes(list(range(32)))) == 1
    )  # the last token is computed


def test_blocks_kept_without_drafter_entries_are_not_found_by_a_drafting_batch_until_kept_with_them():
    prompt, store = list(range(40)), PrefixStore()
    store.save({"target": cache_with(1.0)}, 0, block_hashes(prompt), drafter=False)
    assert store.hits(block_hashes(prompt), drafter=True) == 0
    store.save({"target": cache_with(2.0), "drafter": cache_with(3.0)}, 0, block_hashes(prompt), drafter=True)
    assert store.hits(block_hashes(prompt), drafter=True) == 2
    target, drafter = cache_with(0.0), cache_with(0.0)
    store.restore({"target": target, "drafter": drafter}, 0, block_hashes(prompt))
    restored = slice(0, 2 * BLOCK_SIZE)
    assert bool((target.entries[0][0][0, restored] == 2.0).all() and (drafter.entries[0][0][0, restored] == 3.0).all())
    assert bool((target.entries[0][0][0, 2 * BLOCK_SIZE :] == 0.0).all())


def test_eviction_is_least_recently_used_and_the_same_on_every_rank():
    """A rank without the drafter keeps the same blocks as the drafter's rank: the same prompts, the same order."""
    first, last = PrefixStore(capacity_blocks=3), PrefixStore(capacity_blocks=3)
    prompts = [[p * 100 + i for i in range(40)] for p in range(3)]
    for prompt in prompts:
        first.save({"target": cache_with(1.0)}, 0, block_hashes(prompt), drafter=True)
        last.save({"target": cache_with(1.0), "drafter": cache_with(1.0)}, 0, block_hashes(prompt), drafter=True)
    assert list(first.blocks) == list(last.blocks) == [*block_hashes(prompts[1])[1:], *block_hashes(prompts[2])]
