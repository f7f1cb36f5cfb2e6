"""Single-process greedy decoding with a KV cache: the plain-decoding reference for one stage
that owns the whole target (embedding, every layer, head). The pipeline runtime is tested against it."""

from __future__ import annotations

import torch

from specdoctor.runtime.cache.kv_cache import new_cache
from specdoctor.runtime.decode.pipeline import pad_right
from specdoctor.runtime.models.stage import TargetStage


@torch.no_grad()
def greedy_generate(
    stage: TargetStage, prompts: list[list[int]], max_new_tokens: int, eos_ids: tuple[int, ...] = ()
) -> list[list[int]]:
    """Greedy continuations of each prompt (without the prompt), stopping at EOS or max_new_tokens."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    param = next(stage.parameters())
    ids, lengths = pad_right(prompts, param.device)
    batch = len(prompts)
    cache = new_cache(
        stage.config, stage.layer_ids, batch, int(lengths.max()) + max_new_tokens, param.dtype, param.device
    )
    positions = torch.arange(ids.shape[1], device=param.device).expand(batch, -1)
    every_row = torch.ones(batch, dtype=torch.bool, device=param.device)
    cache.begin(valid_end=lengths, keep_positions=False)
    hidden = stage(ids, positions, cache)
    cache.commit(lengths - 1, every_row)  # hybrid models: each row's recurrent state after its last prompt token
    rows = torch.arange(batch, device=param.device)
    next_tokens = stage.logits(hidden[rows, lengths - 1]).argmax(-1)  # [B]
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [False] * batch
    for step in range(max_new_tokens):
        for row, token in enumerate(next_tokens.tolist()):
            if not done[row]:
                outputs[row].append(token)
                done[row] = token in eos_ids
        if all(done) or step == max_new_tokens - 1:
            break
        cache.begin(valid_end=None, keep_positions=False)
        hidden = stage(next_tokens[:, None], (lengths + step)[:, None], cache)
        cache.commit(torch.zeros_like(lengths), every_row)
        next_tokens = stage.logits(hidden[:, -1]).argmax(-1)
    return outputs
