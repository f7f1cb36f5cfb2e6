"""The target model, buildable as one pipeline stage: a range of layers, plus the embedding
and the final norm + head when this stage owns them (else `PPMissingLayer` placeholders)."""

from __future__ import annotations

import torch
from torch import nn

from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.kv_cache import KVCache
from specdoctor.runtime.models.layers import PPMissingLayer
from specdoctor.runtime.models.registry import family_of
from specdoctor.runtime.models.rope import rotary_cos_sin


class TargetStage(nn.Module):
    def __init__(self, config: ModelConfig, layers: range, has_embedding: bool, has_head: bool):
        super().__init__()
        self.config = config
        self.layer_ids = list(layers)
        hidden = config.hidden_size
        # Parameter names equal the checkpoint keys: model.embed_tokens, model.layers.{i}, model.norm, lm_head.
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, hidden) if has_embedding else PPMissingLayer()
        family = family_of(config)
        self.model.layers = nn.ModuleDict({str(i): family.decoder_layer(config, i) for i in self.layer_ids})
        self.model.norm = family.norm(hidden, config.rms_norm_eps) if has_head else PPMissingLayer()
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False) if has_head else PPMissingLayer()

    @property
    def has_embedding(self) -> bool:
        return not isinstance(self.model.embed_tokens, PPMissingLayer)

    @property
    def has_head(self) -> bool:
        return not isinstance(self.lm_head, PPMissingLayer)

    def forward(
        self,
        inputs: torch.Tensor,  # [B, T] token ids on the first stage, else [B, T, H] hidden states
        positions: torch.Tensor,  # [B, T] absolute positions
        cache: KVCache | None = None,
    ) -> torch.Tensor:  # [B, T, H] hidden states after this stage's layers, before the final norm
        # The last stage may hold the (tied) embedding too, but it is fed hidden states.
        x = inputs if inputs.is_floating_point() else self.model.embed_tokens(inputs)
        if cache is not None:
            cache.plan(positions)
        return self.run_layers(x, positions, rotary_cos_sin(self.config, positions, x.dtype), cache)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, rotary, cache: KVCache | None) -> torch.Tensor:
        """The stage's layers: the part of a step `--compile` compiles (runtime/compile.py)."""
        for layer in self.model.layers.values():
            x = layer(x, positions, rotary, cache)
        return x

    def head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final-normed hidden states [B, T, H], logits [B, T, V]) of the last stage's output [B, T, H].
        The normed states are what engines feed the MTP drafter (docs/engine-semantics.md §MTP step)."""
        final = self.model.norm(hidden)
        return final, self.lm_head(final)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, V]
        return self.head(hidden)[1]
