"""One Qwen3 target and its draft models, written once per session by transformers."""

from __future__ import annotations

import pytest

from tests.helpers.draft_models import save_cut_down, save_other_family, save_target

SHORT_RANGE = 16  # positions: every battery prompt passes it


@pytest.fixture(scope="session")
def dm_target(tmp_path_factory):
    return save_target(tmp_path_factory.mktemp("dm-target"))


@pytest.fixture(scope="session")
def first_layers(tmp_path_factory, dm_target):
    """The target's first two of four layers, its embedding and head."""
    return save_cut_down(dm_target, tmp_path_factory.mktemp("drafts") / "first-layers", num_hidden_layers=2)


@pytest.fixture(scope="session")
def short_range(tmp_path_factory, dm_target):
    """The whole target as its own draft model, with a position range of SHORT_RANGE: every draft passes
    verification until an engine's length gate replaces the drafts."""
    return save_cut_down(dm_target, tmp_path_factory.mktemp("drafts") / "short", max_position_embeddings=SHORT_RANGE)


@pytest.fixture(scope="session")
def llama_draft(tmp_path_factory):
    return save_other_family(tmp_path_factory.mktemp("drafts") / "llama")
