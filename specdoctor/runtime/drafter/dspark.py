"""The DSpark drafter kind: a block drafter that is a checkpoint of its own (docs/dspark.md). Its own tensors
come from the drafter checkpoint; its embedding and head are the target's unless it ships them, and under PP
the target's embedding lives on the first rank while the drafter runs on the last. The policies are the
shared ladder's (policy.py), with two DSpark rules: a shipped embedding is loaded under every policy, and
engine-legacy loads the head as fixed does (vLLM 0.32 shares the target's lm_head at any PP size).
`--markov-policy unloaded` leaves markov_w1 and markov_w2 as allocated (the fill).
"""

from __future__ import annotations

import torch

from specdoctor.runtime.checkpoint.keys import target_embedding_key, target_head_key
from specdoctor.runtime.checkpoint.loader import allocate, load_module, materialize
from specdoctor.runtime.drafter.checkpoint import OwnCheckpointKind
from specdoctor.runtime.drafter.kind import DEFAULT_SPECULATIVE_TOKENS, EMBEDDING, HEAD
from specdoctor.runtime.drafter.policy import Placer, Provenance
from specdoctor.runtime.models.dspark import (
    ARCHITECTURES,
    DSparkDrafter,
    is_dspark_config,
    pairing_problems,
    read_dspark_config,
)
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import MarkovPolicy, RuntimeOptions

MARKOV = "markov_head."
CONFIDENCE = "confidence_head."


class DSparkKind(OwnCheckpointKind):
    """A DSpark block drafter: a checkpoint of its own that reads taps of the target's layers and drafts its
    whole block in one pass, on the last rank."""

    name = "dspark"
    label = "DSpark drafter"
    stats_parts = ("embed_tokens", "lm_head", "markov_w1", "markov_w2", "fc", "hidden_norm")
    drafts_in_blocks = True
    misread_shift = -1  # target_layer_ids taken as entries without vLLM's + 1: each layer's input
    claims = staticmethod(is_dspark_config)
    read_config = staticmethod(read_dspark_config)

    @staticmethod
    def recognised() -> str:
        return f"a DSpark drafter, {' or '.join(ARCHITECTURES)} with model_type qwen3"

    @property
    def taps(self) -> tuple[int, ...]:
        return self.drafter.config.tap_entries

    def default_speculative_tokens(self) -> int:
        """vLLM's default for a DSpark drafter is its block size."""
        return self.drafter.config.block_size or DEFAULT_SPECULATIVE_TOKENS

    def problems(self) -> list[str]:
        return pairing_problems(self.drafter.config, self.target.config)

    def config_summary(self) -> dict:
        config = self.drafter.config
        return {
            "architecture": config.architecture,
            "target_layer_ids": list(config.layer_ids),
            "block_size": config.block_size,
            "layers": config.num_layers,
            "markov_rank": config.markov_rank,
            "mask_token_id": config.mask_token_id,
        }

    def module(self) -> DSparkDrafter:
        module = DSparkDrafter(self.drafter.config)
        if module.config.confidence_head and not any(key.startswith(CONFIDENCE) for key in self.drafter.tensors):
            del module.confidence_head  # vLLM drops a configured head the checkpoint does not ship
        return module

    def build(
        self, stage: TargetStage, options: RuntimeOptions, device: torch.device
    ) -> tuple[DSparkDrafter, Provenance]:
        own = self.drafter
        lazy = any(source.map_weights for source in self.checkpoints)
        drafter = allocate(self.module, options.dtype.torch(), device, lazy)
        provenance = Provenance()
        markov_unloaded = options.markov_policy == MarkovPolicy.UNLOADED

        def own_key(name: str) -> str | None:
            skipped = name in (EMBEDDING, HEAD) or (markov_unloaded and name.startswith(MARKOV))
            return None if skipped else name

        body = load_module(drafter, own, own_key)
        provenance.read(body.filled, lambda name: name)
        provenance.missing(body.missing)
        place = Placer(drafter, stage, options, provenance, device)
        if markov_unloaded:
            for module in ("markov_head.markov_w1", "markov_head.markov_w2"):
                place.leave_unloaded(module, stage.lm_head)
        target = self.target
        place.embedding(self.own_source(EMBEDDING), (target, target_embedding_key(target)), own_copy_first=True)
        place.head("lm_head", self.own_source(HEAD), (target, target_head_key(target)), self.head_policy(options))
        materialize(drafter, device)
        return drafter.eval(), provenance
