"""The MTP drafter, run on the last pipeline rank: its own token embedding (which engines must fill
from the target checkpoint) and the family's MTP layers, each of which says how it takes its input and
gives its output (docs/engine-semantics.md §MTP step)."""

from __future__ import annotations

import torch
from torch import nn

from specdoctor.runtime import tensor_parallel
from specdoctor.runtime.cache.kv_cache import KVCache, new_cache
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.models.parallel_layers import VocabParallelEmbedding
from specdoctor.runtime.models.registry import family_of
from specdoctor.runtime.models.rope import rotary_cos_sin, rotary_tables
from specdoctor.runtime.sampling import greedy_tokens
from specdoctor.runtime.sharding import local_config


def draft_chain(step, next_tokens, hidden, positions, base, cache: KVCache, k: int):
    """A chain drafter's proposal (MTP, EAGLE-3): yields each draft's logits [B, V]; send() back each picked
    token [B]. Step 0 runs `step` over every new position (next_tokens, hidden [B, T, H], positions [B, T]:
    filling the cache), then the chain goes on from `base` [B], the last accepted position, each step fed
    its own output state and proposal. `step(tokens, hidden, positions, cache)` -> (state, logits)."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    out, logits = step(next_tokens, hidden, positions, cache=cache)
    out, logits, position = out[rows, base][:, None], logits[rows, base], positions[rows, base][:, None]
    for _ in range(k):
        token = yield logits
        position = position + 1
        out, step_logits = step(token[:, None], out, position, cache=cache)
        logits = step_logits[:, 0]


class MtpDrafter(nn.Module):
    graph_methods = ("run_layers", "greedy_chain", "fill_layers")  # the DraftingModule protocol's

    def __init__(self, config: ModelConfig):
        super().__init__()
        config = self.config = local_config(config, tensor_parallel.current().size)  # this TP rank's slice
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        layer = family_of(config).mtp_layer
        self.layers = nn.ModuleDict({str(i): layer(config, i) for i in config.mtp_layer_ids})

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        config = self.config
        return new_cache(config, config.mtp_layer_ids, batch, max_len, dtype, device, drafter=True)

    def draft(self, next_tokens, hidden, positions, base, cache: KVCache, k: int):
        return draft_chain(self, next_tokens, hidden, positions, base, cache, k)

    def greedy_drafts(self, next_tokens, hidden, positions, base, cache: KVCache, k: int) -> torch.Tensor:
        """`draft`'s chain with every draft its step's argmax, [B, k], in one call: the steps' keys and rotary
        tables are found before it (the last step reaches the furthest position plus k - 1), so under --compile
        the whole chain is one graph instead of a graph and its host work per step."""
        keys = cache.keys(int(positions.max()) + k, positions.device)
        tables = rotary_tables(self.config, positions.device, hidden.dtype)
        return self.greedy_chain(next_tokens, hidden, positions, base, cache, keys, tables, k)

    def greedy_chain(self, next_tokens, hidden, positions, base, cache: KVCache, keys, tables, k: int) -> torch.Tensor:
        def step(tokens, prev_hidden, step_positions, output_at=None):
            cache.plan_keys(step_positions, keys)
            rotary = (tables[0][step_positions], tables[1][step_positions])
            # The class's run_layers: under --compile the instance's routes through graphs, and this is one.
            layers = type(self).run_layers
            return layers(self, self.embed_tokens(tokens), prev_hidden, step_positions, rotary, cache, output_at)

        # Step 0 fills the cache at every new position; only `base`'s output goes on (and needs the head).
        out, logits = step(next_tokens, hidden, positions, output_at=base)
        position = positions.gather(1, base[:, None])
        drafts = [greedy_tokens(logits[:, 0])]
        for _ in range(k - 1):
            position = position + 1
            out, logits = step(drafts[-1][:, None], out, position)
            drafts.append(greedy_tokens(logits[:, 0]))
        return torch.stack(drafts, dim=1)

    @property
    def first_layer(self) -> nn.Module:
        """The MTP layer every chain step runs (see `forward`)."""
        return self.layers[str(self.config.mtp_layer_ids[0])]

    @property
    def fills_cache_only(self) -> bool:
        """Whether its MTP layer can store a pass's cache entries without the rest of the pass."""
        return hasattr(self.first_layer.mixer, "fill_cache")

    def fill(self, next_tokens, hidden, positions, cache: KVCache) -> None:
        """The cache entries a chain's first pass over these positions stores, and nothing else: a plain step's."""
        cache.plan(positions)
        rotary = rotary_cos_sin(self.config, positions, hidden.dtype)
        self.fill_layers(self.embed_tokens(next_tokens), hidden, positions, rotary, cache)

    def fill_layers(self, embeds, prev_hidden, positions, rotary, cache: KVCache) -> torch.Tensor:
        layer = self.first_layer
        x = layer.input_layernorm(layer.mtp_input(embeds, prev_hidden, positions))
        layer.mixer.fill_cache(x, positions, rotary, cache)
        return x  # a graph returns a tensor

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] the token after each position (the target's, or the previous proposal)
        prev_hidden: torch.Tensor,  # [B, T, H] the target's output after its final norm, or this drafter's own
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # hidden [B, T, H] (fed to the next step), logits [B, T, V]
        # Every chain step runs the first MTP layer, as vLLM 0.32's proposer does: it never passes the
        # step index the model code would take modulo the layer count (docs/engine-semantics.md §MTP step).
        embeds = self.embed_tokens(tokens)  # an aliased PPMissingLayer hands back the token ids: the step fails
        if cache is not None:
            cache.plan(positions)
        return self.run_layers(
            embeds, prev_hidden, positions, rotary_cos_sin(self.config, positions, prev_hidden.dtype), cache
        )

    def run_layers(self, embeds, prev_hidden, positions, rotary, cache: KVCache | None, output_at=None):
        """The MTP layer's input projection, block and head: the part of a step `--compile` compiles. With
        `output_at` [B], the output (state and logits, [B, 1, ...]) at that one position of each row."""
        layer = self.first_layer
        hidden = layer(layer.mtp_input(embeds, prev_hidden, positions), positions, rotary, cache)
        if output_at is not None:
            hidden = hidden.gather(1, output_at[:, None, None].expand(-1, 1, hidden.shape[-1]))
        return layer.mtp_output(hidden)
