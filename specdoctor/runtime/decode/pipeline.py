"""One rank's part of the pipeline: its stage, its drafter (on the drafter's rank), and the pass that runs
this rank's layers and moves hidden states (and a drafter's taps) to the next rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdoctor.runtime.background_compile import BackgroundCompiler
from specdoctor.runtime.cache.kv_cache import KVCache, new_cache
from specdoctor.runtime.cache.prefix import PrefixStore
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.comm import PipelineComm
from specdoctor.runtime.drafter.kind import DrafterKind, DraftingModule
from specdoctor.runtime.drafter.policy import Provenance
from specdoctor.runtime.drafter.taps import TapRoute
from specdoctor.runtime.faults import Faults
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.partition import Placement


@dataclass
class RankModel:
    placement: Placement
    stage: TargetStage
    drafter: DraftingModule | None  # the live drafter, on the drafter's rank
    comm: PipelineComm
    device: torch.device
    dtype: torch.dtype
    checkpoint: Checkpoint | None = None
    provenance: Provenance = field(default_factory=Provenance)  # drafter tensor -> where it came from
    state_rollback: bool = True  # False reproduces an engine that never rolls recurrent states back
    taps: TapRoute | None = None  # the drafter's taps, where it reads any: this rank's part in moving them
    kind: DrafterKind | None = None  # the pipeline's kind of drafter, on every rank; None: none
    faults: Faults = field(default_factory=Faults)  # the engine faults reproduced (--fault)
    prefix_store: PrefixStore | None = None  # prefix caching's blocks, kept across batches (serve)
    graphs: BackgroundCompiler | None = None  # --compile: the graphs compiled behind the passes
    tokenizer: Path | None = None  # the tokenizer.json structured output compiles its grammars for
    eos_token_ids: tuple[int, ...] = ()  # the model's, where a grammar may end

    def swap_ready(self) -> None:
        """A step boundary: swap in the graphs compiled since the last (every rank calls it at the same steps)."""
        if self.graphs is not None:
            self.graphs.swap_ready()

    def finish_compiles(self, beat=lambda: None) -> None:
        """Wait for every graph asked for so far and swap them in (`bench`, the tests): the ranks of the pipeline
        together, a peer still compiling waited for, not timed out. `beat()` about once a second while waiting."""
        if self.graphs is None:
            return
        with self.comm.working("compiling"):
            self.graphs.wait_idle(beat)
        self.comm.wait_for_peers("to finish compiling")
        self.graphs.swap_ready()

    @property
    def speculates(self) -> bool:
        return self.kind is not None

    def drafter_features(self, tokens: torch.Tensor, final: torch.Tensor, taps: torch.Tensor | None) -> torch.Tensor:
        """What the drafter reads at a pass's positions: the tokens there, else its taps, else the final-normed
        states."""
        if self.kind is not None and self.kind.reads_tokens:
            return tokens
        return final if taps is None else taps

    def cache(self, batch: int, max_len: int, drafter: bool = False) -> KVCache:
        """A cache for this rank's layers, or for the drafter's."""
        if drafter:
            return self.drafter.new_cache(batch, max_len, self.dtype, self.device)
        config = self.stage.config
        return new_cache(
            config, self.stage.layer_ids, batch, max_len, self.dtype, self.device, False, self.state_rollback
        )


def pad_right(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, Lmax] padded with 0 (padding lands past each sequence's end, masked by position)
    and the prompt lengths [B]."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt, device=device)
    return ids, lengths


def pipeline_pass(model: RankModel, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, captured=None):
    """Run this rank's layers on a [B, T] step. The last rank gets (hidden states [B, T, H], a block drafter's
        taps [B, T, taps, H] or None); the others (None, None). Taps travel with the hidden states
    (runtime/drafter/taps.py).
        `captured`, when given, receives every entry this rank's stage captured (the tap probe)."""
    placement, stage, route = model.placement, model.stage, model.taps
    upstream: list[torch.Tensor] = []
    if placement.is_first:
        inputs = tokens
    else:
        received = route.received if route else 0
        width = (1 + received,) if received else ()
        inputs = model.comm.recv_prev((*tokens.shape, *width, stage.config.hidden_size), model.dtype)
        if received:
            inputs, *upstream = inputs.unbind(2)
    hidden, own = stage.forward_with_taps(inputs, positions, cache)
    if captured is not None:
        captured.update(own)
    if placement.is_last:
        return hidden, route.assemble(upstream, own, hidden) if route else None
    sent = [*upstream, *(own[entry] for entry in route.own)] if route and route.sent else []
    model.comm.send_next(torch.stack([hidden, *sent], dim=2) if sent else hidden)
    return None, None


@torch.no_grad()
def prompt_logits(model: RankModel, prompts: list[list[int]]) -> torch.Tensor | None:
    """Target logits at every prompt position, [B, Lmax, V] on the last rank (rows past a prompt's end are padding)."""
    ids, _ = pad_right(prompts, model.device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand(len(prompts), -1)
    hidden, _ = pipeline_pass(model, ids, positions, model.cache(len(prompts), ids.shape[1]))
    return None if hidden is None else model.stage.logits(hidden).float().cpu()
