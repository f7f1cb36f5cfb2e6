"""A separate small model as the drafter (vLLM's `"method": "draft_model"`): a whole causal LM of a runtime
family, with its own embedding, layers, head and KV cache, on the last pipeline rank (docs/draft-model.md).

It reads no state of the target's, only tokens: as vLLM's DraftModelProposer feeds it, the tokens at the
target's positions (not shifted, as an EAGLE head's are) and the token sampled after the last accepted one in
one extra slot; its logits there are the first draft, and each draft is fed back for the next.
"""

from __future__ import annotations

import torch

from specdoctor.runtime.cache.kv_cache import KVCache, new_cache
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.models.stage import TargetStage


class DraftModel(TargetStage):
    """Every layer of a draft model, embedding and head included; parameter names are its checkpoint keys."""

    greedy_chain = None  # the DraftingModule protocol's: no argmax chain of its own, no cache-only fill
    fills_cache_only = False

    def __init__(self, config: ModelConfig):
        super().__init__(config, range(config.num_hidden_layers), has_embedding=True, has_head=True)

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        return new_cache(self.config, self.layer_ids, batch, max_len, dtype, device)

    def draft(self, next_tokens, tokens, positions, base, cache: KVCache, k: int):
        """next_tokens [B, T]: the token after each new position; tokens [B, T]: the tokens at them (the first
        is all the draft model needs: the rest, up to `base`, are next_tokens shifted). Yields each draft's
        logits [B, V]; send() back the token picked there [B]."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        inputs = torch.cat([tokens[:, :1], next_tokens], dim=1)  # positions p0, then p0 + 1 .. pT-1 + 1
        input_positions = torch.cat([positions[:, :1], positions + 1], dim=1)
        hidden = self(inputs, input_positions, cache)
        newest = base + 1  # the token sampled after the last accepted position
        logits, position = self.logits(hidden[rows, newest][:, None])[:, 0], input_positions[rows, newest][:, None]
        for _ in range(k):
            token = yield logits
            position = position + 1
            logits = self.logits(self(token[:, None], position, cache))[:, 0]
