"""KVCache (runtime/cache/kv_cache.py): entries written at each token's absolute position are the ones the
attention reads, a row never reads what lies past its own position (padding, rejected drafts, its later
drafts), regrouping keeps each row's entries, and new_cache builds what a config's layers need.

The oracle: a plain dict of what the test wrote at each (row, position), and attention over a row's own
entries recomputed from scratch in plain torch."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from specdoctor.runtime.cache.kv_cache import KVCache, new_cache
from specdoctor.runtime.cache.linear_state import LinearStates
from specdoctor.runtime.checkpoint.files import DEMO_MODELS
from specdoctor.runtime.checkpoint.reader import Checkpoint

HEADS, WIDTH = 2, 8
SHAPES = ((HEADS, WIDTH), (HEADS, WIDTH))  # keys and values


class Written:
    """What the test stored: row -> position -> (key, value), the last write winning, as a cache should."""

    def __init__(self, batch: int):
        self.rows: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(batch)]

    def record(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        for row, entries in enumerate(self.rows):
            for t, position in enumerate(positions[row].tolist()):
                entries[position] = (keys[row, t], values[row, t])

    def attend(self, row: int, query: torch.Tensor, position: int) -> torch.Tensor:
        """Softmax attention of one query [heads, width] over the row's entries at positions 0..position."""
        keys = torch.stack([self.rows[row][p][0] for p in range(position + 1)])  # [S, heads, width]
        values = torch.stack([self.rows[row][p][1] for p in range(position + 1)])
        scores = torch.einsum("hd,shd->hs", query, keys) / math.sqrt(query.shape[-1])
        return torch.einsum("hs,shd->hd", scores.softmax(-1), values)


def step(cache: KVCache, written: Written, layer: int, positions: torch.Tensor, generator, scale=None):
    """One forward's attention over the cache for `layer`, as runtime/models/attention.py runs it, on random
    queries, keys and values (keys and values multiplied by `scale` [B, T], when given); returns (queries,
    output [B, T, heads, width], the entries update returned)."""
    batch, length = positions.shape
    queries, keys, values = (
        torch.randn(batch, length, HEADS, WIDTH, generator=generator, dtype=torch.float64) for _ in range(3)
    )
    if scale is not None:
        keys, values = keys * scale[..., None, None], values * scale[..., None, None]
    cache.plan(positions)
    entries = cache.update(layer, positions, keys, values)
    written.record(positions, keys, values)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), entries[0].transpose(1, 2), entries[1].transpose(1, 2), attn_mask=cache.causal_mask()
    ).transpose(1, 2)
    return queries, out, entries


def assert_reads_only_its_own_past(written: Written, positions: torch.Tensor, queries, out) -> None:
    for row in range(positions.shape[0]):
        for t, position in enumerate(positions[row].tolist()):
            expected = written.attend(row, queries[row, t], position)
            torch.testing.assert_close(out[row, t], expected, rtol=1e-10, atol=1e-10)


def test_writes_land_at_their_positions_and_attention_reads_only_each_rows_past():
    """Two rows of different lengths share a batch: a padded prompt pass (the short row's padding writes
    50x larger entries past its end), a speculative verification whose drafts are then partly rejected, and
    the steps after it from each row's own position. Every read equals attention over that row's entries up
    to the query's position, recomputed from what was written; the padding and the rejected drafts stay in
    the buffer, inside the span the longer row needs, but are never read."""
    generator = torch.Generator().manual_seed(0)
    cache = KVCache([3, 7], batch=2, max_len=16, shapes=SHAPES, dtype=torch.float64, device="cpu")
    written = Written(2)

    # Prompt pass: row 0 has 3 tokens, row 1 has 6; both run positions 0..5, row 0's 3..5 being padding.
    positions = torch.arange(6).expand(2, -1)
    padding = torch.ones(2, 6, dtype=torch.float64)
    padding[0, 3:] = 50
    queries, out, entries = step(cache, written, 3, positions, generator, padding)
    assert [tuple(e.shape) for e in entries] == [(2, 6, HEADS, WIDTH)] * 2  # the span: up to the furthest position
    for row in range(2):
        for position in range(6):
            assert torch.equal(entries[0][row, position], written.rows[row][position][0])
            assert torch.equal(entries[1][row, position], written.rows[row][position][1])
    assert_reads_only_its_own_past(written, positions, queries, out)

    # Verification of each row's pending token and 3 drafts at its own positions (row 0 overwrites its
    # padding from 3 on); layer 7's buffers are untouched by layer 3's writes.
    positions = torch.tensor([[3, 4, 5, 6], [6, 7, 8, 9]])
    queries, out, _ = step(cache, written, 3, positions, generator)
    assert_reads_only_its_own_past(written, positions, queries, out)
    assert not cache.entries[7][0].any() and not cache.entries[7][1].any()

    # Row 0 accepted no draft (its next token at 4), row 1 all three (at 10). A plain decode step: row 0's
    # rejected drafts at 5 and 6 lie inside this step's span (11) and must not be read.
    positions = torch.tensor([[4], [10]])
    queries, out, entries = step(cache, written, 3, positions, generator)
    assert entries[0].shape[1] == 11
    assert torch.equal(entries[0][0, 5], written.rows[0][5][0])  # still there, only masked
    assert_reads_only_its_own_past(written, positions, queries, out)

    # The next verification: each query sees its own position and before, never the drafts after it.
    positions = torch.tensor([[5, 6, 7, 8], [11, 12, 13, 14]])
    queries, out, _ = step(cache, written, 3, positions, generator)
    assert_reads_only_its_own_past(written, positions, queries, out)


def test_the_mask_is_causal_by_absolute_position_and_whole_block_sees_the_rows_last():
    cache = KVCache([0], batch=2, max_len=12, shapes=SHAPES, dtype=torch.float32, device="cpu")
    positions = torch.tensor([[2, 3, 4], [7, 8, 9]])
    cache.plan(positions)
    mask = cache.causal_mask()
    assert mask.shape == (2, 1, 3, 10) and mask.dtype == torch.bool
    for row in range(2):
        for t in range(3):
            assert mask[row, 0, t].tolist() == [s <= positions[row, t] for s in range(10)]
    cache.plan(positions, whole_block=True)  # a block drafter's block: every query sees up to the row's last
    block = cache.causal_mask()
    for row in range(2):
        last = int(positions[row].max())
        for t in range(3):
            assert block[row, 0, t].tolist() == [s <= last for s in range(10)]


def test_a_position_past_the_cache_length_is_refused():
    cache = KVCache([0], batch=1, max_len=8, shapes=SHAPES, dtype=torch.float32, device="cpu")
    cache.plan(torch.tensor([[7]]))  # the last slot is fine
    with pytest.raises(ValueError, match="position 8 is beyond the KV cache length 8"):
        cache.plan(torch.tensor([[6, 7, 8]]))


def filled(batch: int, max_len: int, generator, states=None, length: int | None = None) -> tuple[KVCache, Written]:
    """A cache whose layers 1 and 4 hold entries at positions 0..length-1 (default: all of it)."""
    cache = KVCache([1, 4], batch, max_len, SHAPES, torch.float64, "cpu", states)
    written = Written(batch)
    positions = torch.arange(length or max_len).expand(batch, -1)
    for layer in (1, 4):
        step(cache, written if layer == 1 else Written(batch), layer, positions, generator)
    return cache, written


def test_regroup_concatenates_pads_and_selects_rows_keeping_each_rows_entries():
    """Requests join a running batch (a cache of 2 rows, 6 long, joins one of 3 rows, 10 long) and some
    leave: row i of the result is row rows[i] of the two stacked, zero-padded to the longer length."""
    generator = torch.Generator().manual_seed(1)
    first, _ = filled(2, 6, generator)
    second, _ = filled(3, 10, generator)
    rows = [4, 0, 2]
    joined = KVCache.regroup([first, second], rows)
    assert (joined.batch, joined.max_len) == (3, 10) and joined.states is None
    sources = [(first, 0), (first, 1), (second, 0), (second, 1), (second, 2)]
    for layer in (1, 4):
        for n in range(2):
            buffer = joined.entries[layer][n]
            assert buffer.shape == (3, 10, HEADS, WIDTH)
            for i, row in enumerate(rows):
                cache, source_row = sources[row]
                stored = cache.entries[layer][n][source_row]
                assert torch.equal(buffer[i, : cache.max_len], stored)
                assert not buffer[i, cache.max_len :].any()  # the padding a shorter cache gets is zero
    everything = KVCache.regroup([first, second])
    assert everything.batch == 5 and everything.entries[1][0].shape == (5, 10, HEADS, WIDTH)


def test_after_a_regroup_attention_reads_each_rows_own_entries():
    """The joined cache serves the next step: each row's reads equal attention over the entries written
    for the request it came from, wherever that request's row now sits."""
    generator = torch.Generator().manual_seed(2)
    first, first_written = filled(2, 8, generator, length=5)
    second, second_written = filled(2, 12, generator, length=9)
    rows = [3, 1, 2]  # second's row 1, first's row 1, second's row 0
    joined = KVCache.regroup([first, second], rows)
    history = [*first_written.rows, *second_written.rows]
    written = Written(3)
    written.rows = [dict(history[row]) for row in rows]
    positions = torch.tensor([[9], [5], [9]])  # each at its own length
    queries, out, _ = step(joined, written, 1, positions, generator)
    assert_reads_only_its_own_past(written, positions, queries, out)


def test_regroup_carries_the_recurrent_states_in_the_same_row_order():
    generator = torch.Generator().manual_seed(3)
    caches = []
    for batch in (2, 3):
        states = LinearStates([0], batch, (4, 3), (2, 3, 5), torch.float64, "cpu")
        states.conv[0] = torch.randn(batch, 4, 3, generator=generator, dtype=torch.float64)
        states.recurrent[0] = torch.randn(batch, 2, 3, 5, generator=generator)
        caches.append(filled(batch, 4, generator, states)[0])
    rows = [1, 4, 2]
    joined = KVCache.regroup(caches, rows)
    by_hand = [(caches[0], 0), (caches[0], 1), (caches[1], 0), (caches[1], 1), (caches[1], 2)]
    for i, row in enumerate(rows):
        cache, source_row = by_hand[row]
        assert torch.equal(joined.states.conv[0][i], cache.states.conv[0][source_row])
        assert torch.equal(joined.states.recurrent[0][i], cache.states.recurrent[0][source_row])
        assert torch.equal(joined.entries[1][0][i], cache.entries[1][0][source_row])


def test_begin_and_commit_reach_the_recurrent_states_and_are_harmless_without_them():
    plain = KVCache([0], 2, 4, SHAPES, torch.float32, "cpu")
    plain.begin(torch.tensor([2, 3]), keep_positions=False)
    plain.commit(torch.tensor([1, 2]), torch.tensor([True, True]))  # attention only: nothing to keep

    states = LinearStates([5], 2, (3, 2), (1, 2, 2), torch.float64, "cpu")
    cache = KVCache([0], 2, 4, SHAPES, torch.float64, "cpu", states)
    ends = torch.tensor([2, 3])
    cache.begin(ends, keep_positions=True)
    assert states.valid_end is ends and states.keep_positions
    windows = torch.arange(2 * 4 * 3 * 2, dtype=torch.float64).view(2, 4, 3, 2)
    after = torch.arange(2 * 4 * 1 * 2 * 2, dtype=torch.float32).view(2, 4, 1, 2, 2)
    states.stage(5, windows, after)
    cache.commit(torch.tensor([1, 3]), torch.tensor([True, True]))
    assert torch.equal(states.conv[5], torch.stack([windows[0, 1], windows[1, 3]]))
    assert torch.equal(states.recurrent[5], torch.stack([after[0, 1], after[1, 3]]))


def demo_config(name: str):
    return Checkpoint(name).config, json.loads((DEMO_MODELS[name] / "config.json").read_text())


def test_new_cache_gives_attention_layers_keys_and_values_and_linear_layers_states():
    """demo-hybrid (Qwen3.5's layout): layers 0-2 are linear attention, 3 full, by its config.json; the
    shapes are computed here from that file's fields."""
    config, raw = demo_config("demo-hybrid")
    linear = [i for i, kind in enumerate(raw["layer_types"]) if kind == "linear_attention"]
    assert linear == [0, 1, 2]
    cache = new_cache(config, [0, 1, 2, 3], batch=3, max_len=20, dtype=torch.bfloat16, device="cpu", rollback=False)
    assert sorted(cache.entries) == [3]
    kv = (raw["num_key_value_heads"], raw["head_dim"])
    assert [tuple(b.shape) for b in cache.entries[3]] == [(3, 20, *kv)] * 2
    assert all(b.dtype == torch.bfloat16 and not b.any() for b in cache.entries[3])
    states = cache.states
    assert sorted(states.conv) == sorted(states.recurrent) == linear and states.rollback is False
    channels = 2 * raw["linear_num_key_heads"] * raw["linear_key_head_dim"]
    channels += raw["linear_num_value_heads"] * raw["linear_value_head_dim"]
    for layer in linear:
        assert states.conv[layer].shape == (3, channels, raw["linear_conv_kernel_dim"] - 1)
        assert states.conv[layer].dtype == torch.bfloat16
        heads = raw["linear_num_value_heads"]
        assert states.recurrent[layer].shape == (3, heads, raw["linear_key_head_dim"], raw["linear_value_head_dim"])
        assert states.recurrent[layer].dtype == torch.float32  # the delta-rule state stays fp32

    # The drafter's MTP layer is numbered 0 in Qwen3.5's checkpoints, like a linear target layer, yet is
    # full attention: a drafter cache is keys and values only.
    drafter = new_cache(config, config.mtp_layer_ids, 3, 20, torch.float32, "cpu", drafter=True)
    assert config.mtp_layer_ids == [0] and sorted(drafter.entries) == [0] and drafter.states is None

    attention_only = new_cache(config, [3], 1, 4, torch.float32, "cpu")
    assert attention_only.states is None


def test_new_cache_for_mla_caches_the_latent_the_rotary_key_and_the_indexer_keys():
    config, raw = demo_config("demo-mla")
    cache = new_cache(config, [1, 2], batch=2, max_len=7, dtype=torch.float32, device="cpu")
    expected = [(2, 7, 1, raw["kv_lora_rank"]), (2, 7, 1, raw["qk_rope_head_dim"]), (2, 7, 1, raw["index_head_dim"])]
    for layer in (1, 2):
        assert [tuple(b.shape) for b in cache.entries[layer]] == expected
    assert cache.states is None
