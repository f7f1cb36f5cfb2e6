"""The target model, buildable as one pipeline stage: a range of layers, plus the embedding
and the final norm + head when this stage owns them (else `PPMissingLayer` placeholders)."""

from __future__ import annotations

import torch
from torch import nn

from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.models.layers import PPMissingLayer
from specdoctor.runtime.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding
from specdoctor.runtime.models.registry import family_of
from specdoctor.runtime.models.rope import rotary_cos_sin
from specdoctor.runtime.sharding import local_config


class TargetStage(nn.Module):
    graph_methods = ("run_layers",)  # what --compile routes through graphs (runtime/compile.py)

    def __init__(self, config: ModelConfig, layers: range, has_embedding: bool, has_head: bool):
        super().__init__()
        config = self.config = local_config(config, tensor_parallel.current().size)  # this TP rank's slice
        self.layer_ids = list(layers)
        hidden = config.hidden_size
        # Parameter names equal the checkpoint keys: model.embed_tokens, model.layers.{i}, model.norm, lm_head.
        self.model = nn.Module()
        self.model.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, hidden) if has_embedding else PPMissingLayer()
        )
        family = family_of(config)
        self.model.layers = nn.ModuleDict({str(i): family.decoder_layer(config, i) for i in self.layer_ids})
        self.model.norm = family.norm(hidden, config.rms_norm_eps) if has_head else PPMissingLayer()
        self.lm_head = ParallelLMHead(hidden, config.vocab_size) if has_head else PPMissingLayer()
        # Residual-stream entries a block drafter reads that this stage captures (runtime/drafter/taps.py): entry j is
        # the state entering layer j, taken after layer j - 1 runs (entry 0, the embedding output, on the first).
        self.tap_entries: tuple[int, ...] = ()

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
        return self.forward_with_taps(inputs, positions, cache)[0]

    def forward_with_taps(
        self, inputs: torch.Tensor, positions: torch.Tensor, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """(the hidden states, as `forward`; each captured entry of `tap_entries` -> its state [B, T, H])."""
        # The last stage may hold the (tied) embedding too, but it is fed hidden states.
        x = inputs if inputs.is_floating_point() else self.model.embed_tokens(inputs)
        if cache is not None:
            cache.plan(positions)
        hidden, taps = self.run_layers(x, positions, rotary_cos_sin(self.config, positions, x.dtype), cache)
        if not inputs.is_floating_point() and 0 in self.tap_entries:  # entry 0 is the first stage's
            taps = {0: x, **taps}
        return hidden, taps

    def run_layers(
        self, x: torch.Tensor, positions: torch.Tensor, rotary, cache: KVCache | None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The stage's layers and their taps: the part of a step `--compile` compiles (runtime/compile.py)."""
        taps = {}
        for layer_id, layer in zip(self.layer_ids, self.model.layers.values(), strict=True):
            x = layer(x, positions, rotary, cache)
            if layer_id + 1 in self.tap_entries:
                taps[layer_id + 1] = x
        return x, taps

    def head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final-normed hidden states [B, T, H], logits [B, T, V]) of the last stage's output [B, T, H].
        The normed states are what engines feed the MTP drafter (docs/engine-semantics.md §MTP step)."""
        final = self.model.norm(hidden)
        return final, self.lm_head(final)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, V]
        return self.head(hidden)[1]
