"""Whole models in this process (PP = 1), loaded by the runtime's own loaders, for the tests and benchmarks."""

from __future__ import annotations

import torch

from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.drafter.loading import Provenance, build_drafter
from specdoctor.runtime.loader import load_full_target
from specdoctor.runtime.models.mtp import MtpDrafter
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import RuntimeOptions


def load_target_and_drafter(checkpoint: Checkpoint) -> tuple[TargetStage, MtpDrafter, Provenance]:
    """The whole target and its drafter loaded the fixed way (the drafter shares the target's embedding)."""
    target = load_full_target(checkpoint)
    drafter, provenance = build_drafter(checkpoint, target, RuntimeOptions(str(checkpoint.path)), torch.device("cpu"))
    return target, drafter, provenance
