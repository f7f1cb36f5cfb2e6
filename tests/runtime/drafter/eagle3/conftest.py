"""One Llama target and the EAGLE-3 heads the tests share (each written once per session by speculators)."""

from __future__ import annotations

import pytest

from tests.helpers.eagle3 import original_layout, save_llama_target, without_tensors, write_head

DRAFT_VOCAB = 200  # of the target's 320: a pruned head with its d2t map


@pytest.fixture(scope="session")
def eagle3_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-target")
    save_llama_target(path)
    return path


@pytest.fixture(scope="session")
def pruned_head(tmp_path_factory, eagle3_target):
    """Speculators format, a pruned vocabulary with d2t, aux ids (1, 3, 6), norm_before_residual, proposing 5."""
    root = tmp_path_factory.mktemp("heads")
    return write_head(root / "pruned", eagle3_target, DRAFT_VOCAB, "1,3,6", "--speculative-tokens", "5")


@pytest.fixture(scope="session")
def shared_head(tmp_path_factory, eagle3_target):
    """Speculators format over the whole vocabulary with norm_before_fc, its aux ids listed out of layer order
    (vLLM captures them in layer order), shipping neither embedding nor head: both are the target's."""
    root = tmp_path_factory.mktemp("heads")
    full = write_head(root / "full", eagle3_target, 320, "6,1,3", "--flag", "norm_before_fc")
    return without_tensors(full, root / "shared", "embed_tokens.weight", "lm_head.weight")


@pytest.fixture(scope="session")
def original_head(tmp_path_factory, eagle3_target):
    """The original EAGLE-3 layout: no aux ids in its config (the engine's default), no norm_before_residual."""
    root = tmp_path_factory.mktemp("heads")
    source = write_head(root / "source", eagle3_target, DRAFT_VOCAB, "2,4,5", "--no-norm-before-residual")
    return original_layout(source, root / "original")


@pytest.fixture(scope="session")
def qwen3_head(tmp_path_factory, eagle3_target):
    """speculators' default layer family: a Qwen3 layer (q/k norm), over the whole vocabulary."""
    root = tmp_path_factory.mktemp("heads")
    return write_head(root / "qwen3", eagle3_target, 320, "1,3,6", "--layer-family", "qwen3")
