"""`serve`'s warm-up plan: the batches of prompts whose prompt passes and decode steps meet every graph a batch of
up to `--max-num-seqs` rows can need, run eager at start-up so the compile thread has every shape to compile
(runtime/background_compile.py) before the traffic meets it."""

from __future__ import annotations

from specdoctor.runtime.cache.prefix import BLOCK_SIZE


def warmup_batches(max_batch: int) -> list[int]:
    """The batch sizes whose passes meet every graph a batch of up to `max_batch` rows can need: 1 (sizes of 1 get
    graphs of their own), each power of two, and `max_batch`. Where a pass's MoE layers switch paths past L tokens
    (runtime/models/moe.py), the draft chain, one graph over a pass of B x (k + 1) tokens and passes of B, takes one
    path in all (B <= L / (k + 1)), the other in all (B > L), or both: that middle range (L / (k + 1), L] spans at
    least a factor of two, so a power of two falls in it whatever L is."""
    return sorted({*(1 << n for n in range(max_batch.bit_length())), max_batch})


def warmup_prompts(max_batch: int, gathered_tokens: int, grouped_from: int | None = None) -> list[list[list[int]]]:
    """The batches of prompts whose prompt passes and decode steps meet every graph a batch of up to `max_batch`
    rows can need, where MoE layers gather experts for passes of up to `gathered_tokens` tokens (the ranks'
    `gathered_token_limit`) and, measured on a CPU rank, run a grouped GEMM from `grouped_from` tokens on (None:
    never): two-token prompts at each of `warmup_batches`, one-token prompts (sizes of 1 get graphs of their own),
    then prompts of 16n + 1 tokens past the limit, each sent twice. The first time their prompt pass takes every
    expert (or the grouped GEMM), which no decode pass of one row (k + 1 <= the limit) nor a two-token prompt pass
    of two reaches; the second time, with prefix caching, it computes the one token past the cached blocks against
    a cache of 16n + 1 positions (a one-token pass over a longer cache is another graph again). Where a grouped
    GEMM runs, prompts just past the limit and just past `grouped_from` tokens a batch come too, so a batch's prompt
    pass meets each side of both switches (a power of two would also equal a head size: a graph traced with two
    sizes equal takes them as one). The one-token passes run at batch 1, 2 (gathered experts up to the
    limit) and the first warm-up batch past the limit (every expert)."""
    sizes = warmup_batches(max_batch)
    one_token = sorted({*sizes[:2], *[batch for batch in sizes if batch > gathered_tokens][:1]})
    batches = [[[1, 2]] * batch for batch in sizes] + [[[1]] * batch for batch in one_token]
    length = BLOCK_SIZE * (gathered_tokens // BLOCK_SIZE + 1) + 1
    for batch in one_token:  # a token of its own per batch size: one size's blocks are no prefix of the other's
        batches += [[[batch] * length] * batch] * 2
        if grouped_from is not None:
            # a token no other warm-up prompt starts with: no cached block shortens their passes
            switches = {gathered_tokens // batch + 1, grouped_from // batch + 1} - {length, 1}  # 1: run above
            batches += [[[max_batch + batch] * tokens] * batch for tokens in sorted(switches)]
    return batches
