"""Whole models in this process (PP = 1), loaded by the runtime's own loaders, for the tests and benchmarks."""

from __future__ import annotations

import torch

from specdoctor.runtime.checkpoint.loader import load_full_target
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.policy import Provenance
from specdoctor.runtime.drafter.registry import open_drafter
from specdoctor.runtime.models.dspark import DSparkDrafter
from specdoctor.runtime.models.mtp import MtpDrafter
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import RuntimeOptions


def load_target_and_drafter(checkpoint: Checkpoint) -> tuple[TargetStage, MtpDrafter | DSparkDrafter, Provenance]:
    """The whole target and its drafter (its MTP layers, or the DSpark checkpoint a demo brings) loaded the
    fixed way (the drafter shares the target's embedding)."""
    target = load_full_target(checkpoint)
    options = RuntimeOptions(str(checkpoint.path))
    kind = open_drafter(checkpoint, options)
    target.tap_entries = kind.taps
    return target, *kind.build(target, options, torch.device("cpu"))


@torch.no_grad()
def mtp_step_error(path, model, reference, first_position: int) -> tuple[float, Provenance]:
    """(relative error of one MTP step of the runtime's drafter against `reference(path, tokens, prev_hidden,
    positions)` on random inputs from `first_position`, the drafter's provenance)."""
    from tests.oracles.test_model_parity import relative_error

    _, drafter, provenance = load_target_and_drafter(Checkpoint(path))
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=generator)
    prev_hidden = torch.randn(2, 12, model.config.hidden_size, generator=generator)
    positions = torch.arange(first_position, first_position + 12).expand(2, -1)
    _, logits = drafter(tokens, prev_hidden, positions)
    return relative_error(logits, reference(path, tokens, prev_hidden, positions)), provenance
