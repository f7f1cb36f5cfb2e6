"""One Qwen3 target and the DSpark drafter the oracle test uses (written once per session by
speculators)."""

from __future__ import annotations

import pytest

from tests.helpers.families import SMALL, save_dense_checkpoint
from tests.tools import TOOLS
from tests.tools.speculators_env import run_speculators

TOOL = TOOLS / "speculators_dspark.py"
TARGET_LAYERS = 6
MASK_TOKEN = SMALL["vocab_size"] - 1


@pytest.fixture(scope="session")
def dspark_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-target")
    save_dense_checkpoint(path, "Qwen3ForCausalLM", 0, num_hidden_layers=TARGET_LAYERS)
    return path


@pytest.fixture(scope="session")
def dspark_drafter(tmp_path_factory, dspark_target):
    """speculators' defaults (sample_from_anchor, a vanilla Markov head, a confidence head with the Markov
    input), 2 full-attention layers, block 4, aux entries (2, 4, 5), as speculators saves it."""
    root = tmp_path_factory.mktemp("dspark")
    run_speculators(TOOL, "write", str(root / "speculators"), "--target", str(dspark_target), "--aux", "2,4,5",
             "--mask-token", str(MASK_TOKEN))  # fmt: skip
    return root / "speculators"
