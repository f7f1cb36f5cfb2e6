"""The EAGLE-3 drafter kind: a head of its own checkpoint that reads aux hidden states of the target's layers
(the taps DSpark reads, under EAGLE's id convention) and drafts a chain on the last rank (docs/eagle3.md).
Its own tensors come from its checkpoint; its embedding and head are the target's where it ships none. The
policies are the shared ladder's (policy.py), with vLLM 0.32's rules: a shipped embedding is loaded under
every policy (engine-legacy, what vLLM 0.32 itself does at PP > 1, leaves an absent one unloaded there), the
head is shared at any PP size; plus `--d2t-policy ignored`: a reduced vocabulary's `d2t` left unloaded
(vLLM's zeros), so draft ids are taken as target ids.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from specdoctor.runtime.checkpoint.keys import target_embedding_key, target_head_key
from specdoctor.runtime.checkpoint.loader import allocate, load_module, materialize
from specdoctor.runtime.drafter.checkpoint import OwnCheckpointKind
from specdoctor.runtime.drafter.kind import DEFAULT_SPECULATIVE_TOKENS, EMBEDDING, HEAD
from specdoctor.runtime.drafter.policy import Origin, Placer, Provenance, TensorSource
from specdoctor.runtime.models.eagle3 import (
    ORIGINAL_ARCHITECTURES,
    Eagle3Drafter,
    aux_entries,
    is_eagle3_config,
    pairing_problems,
    read_eagle3_config,
)
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import D2tPolicy, RuntimeOptions

D2T = "d2t"  # draft id -> target id offsets [draft_vocab] (int64); `t2d` vLLM ignores
ORIGINAL_LAYER = "midlayer."  # the original layout's key prefix of the first layer (vLLM maps it to layers.0.)


class Eagle3Kind(OwnCheckpointKind):
    """An EAGLE-3 head beside its target (speculators or original layout), on the last rank."""

    name = "eagle3"
    label = "EAGLE-3 head"
    stats_parts = ("embed_tokens", "lm_head", "fc", "hidden_norm", "input_norm")
    misread_shift = 1  # the + 1 of DFlash's convention applied to ids that are entries already (sglang#25454)
    read_by_method = True  # vLLM's EAGLEConfig takes a plain Llama or Qwen3 config named by method eagle3
    claims = staticmethod(is_eagle3_config)
    read_config = staticmethod(read_eagle3_config)

    @staticmethod
    def recognised() -> str:
        return f'an EAGLE-3 head, {" or ".join(ORIGINAL_ARCHITECTURES)} or speculators_model_type "eagle3"'

    @property
    def taps(self) -> tuple[int, ...]:
        return aux_entries(self.drafter.config, self.target.config.num_hidden_layers)

    @property
    def draft_vocab_size(self) -> int:
        return self.drafter.config.draft_vocab_size

    def default_speculative_tokens(self) -> int:
        """vLLM's default: the speculators config's proposal length."""
        return self.drafter.config.speculative_tokens or DEFAULT_SPECULATIVE_TOKENS

    def problems(self) -> list[str]:
        """Why this head cannot run beside this target: the pairing, then what its checkpoint lacks."""
        config, own = self.drafter.config, self.drafter.tensors
        problems = pairing_problems(config, self.target.config)
        if config.reduced_vocab and HEAD not in own:
            problems.append(f"a draft vocabulary of {config.draft_vocab_size} ships no lm_head.weight of its own")
        if config.reduced_vocab and D2T not in own:
            problems.append(f"a draft vocabulary of {config.draft_vocab_size} ships no d2t to map it to target ids")
        if config.hidden_size != self.target.config.hidden_size:  # vLLM shares neither across widths
            problems += [
                f"its hidden size {config.hidden_size} is not the target's {self.target.config.hidden_size} and it "
                f"ships no {name} of its own"
                for name in (EMBEDDING, HEAD)
                if name not in own
            ]
        for part in ("fc.weight", "layers.0.self_attn.q_proj.weight"):
            if self.checkpoint_key(part) not in own:
                problems.append(f"the checkpoint has no {self.checkpoint_key(part)}")
        fc, width = own.get("fc.weight"), config.num_aux * config.target_hidden_size
        if fc is not None and len(fc.shape) == 2 and fc.shape[1] != width:
            problems.append(
                f"fc.weight takes {fc.shape[1]} inputs, the config's {config.num_aux} aux states of "
                f"{config.target_hidden_size} give {width}"
            )
        return problems

    def data_problems(self) -> list[str]:
        """A pruned vocabulary's d2t: its size, and the target ids it maps to (read whole: a small tensor)."""
        config, info = self.drafter.config, self.drafter.tensors.get(D2T)
        if not config.reduced_vocab or info is None:
            return []
        if tuple(info.shape) != (config.draft_vocab_size,):
            return [f"d2t has shape {tuple(info.shape)}, the draft vocabulary {config.draft_vocab_size} entries"]
        ids = torch.arange(config.draft_vocab_size) + self.drafter.read(D2T).long()
        if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
            return [f"d2t maps draft ids to target ids outside the vocabulary (0..{config.vocab_size - 1})"]
        return []

    def config_summary(self) -> dict:
        config = self.drafter.config
        return {
            "architecture": config.architecture,
            "layout": config.layout,
            "aux_layer_ids": list(config.aux_layer_ids) if config.aux_layer_ids else None,
            "aux_entries_read": list(self.taps),
            "layers": config.num_layers,
            "draft_vocab_size": config.draft_vocab_size,
            "norm_before_fc": config.norm_before_fc,
            "norm_before_residual": config.norm_before_residual,
        }

    def module(self) -> Eagle3Drafter:
        """vLLM raises a head's max_position_embeddings to the target's: it drafts in the target's positions
        (`_maybe_override_draft_max_position_embeddings`, vllm#48894)."""
        config = self.drafter.config
        return Eagle3Drafter(replace(config, backbone=self.over_target_positions(config.backbone)))

    def checkpoint_key(self, name: str) -> str:
        """The drafter checkpoint's key of a module tensor: an original-layout head may keep layer 0 as
        `midlayer.` (vLLM maps it to `layers.0.`)."""
        original = ORIGINAL_LAYER + name.removeprefix("layers.0.")
        return original if name.startswith("layers.0.") and original in self.drafter.tensors else name

    def build(
        self, stage: TargetStage, options: RuntimeOptions, device: torch.device
    ) -> tuple[Eagle3Drafter, Provenance]:
        lazy = any(source.map_weights for source in self.checkpoints)
        drafter = allocate(self.module, options.dtype.torch(), device, lazy)
        provenance = Provenance()
        d2t_ignored = options.d2t_policy == D2tPolicy.IGNORED

        def own_key(name: str) -> str | None:
            skipped = name in (EMBEDDING, HEAD) or (d2t_ignored and name == D2T)
            return None if skipped else self.checkpoint_key(name)

        body = load_module(drafter, self.drafter, own_key)
        provenance.read(body.filled, self.checkpoint_key)
        provenance.missing(body.missing)
        if d2t_ignored and self.drafter.config.reduced_vocab:
            materialize(drafter, device)
            drafter.d2t.zero_()  # vLLM's draft_id_to_target_id starts as zeros and is only replaced by a load
            provenance.sources[D2T] = TensorSource(Origin.UNFILLED, "zeros")
        place = Placer(drafter, stage, options, provenance, device)
        target = self.target
        place.embedding(self.own_source(EMBEDDING), (target, target_embedding_key(target)), own_copy_first=True)
        place.head("lm_head", self.own_source(HEAD), (target, target_head_key(target)), self.head_policy(options))
        materialize(drafter, device)
        return drafter.eval(), provenance
