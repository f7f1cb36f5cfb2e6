"""Fixtures of the peer suite: the vLLM environment and its servers. A peer that cannot be installed or
started fails the suite with one line; it is never skipped."""

from __future__ import annotations

import pytest

from specdoctor.runtime.checkpoint.files import DEMO_DIR
from tests.peer.vllm_env import PeerUnavailable, ensure_vllm
from tests.peer.vllm_server import VllmServer

K = 3  # draft tokens per step, on both engines


def start_or_fail(factory):
    try:
        return factory()
    except PeerUnavailable as err:
        pytest.fail(f"peer suite: {err}", pytrace=False)


@pytest.fixture(scope="session")
def vllm_python():
    return start_or_fail(ensure_vllm)


@pytest.fixture(scope="session")
def vllm_demo(vllm_python):
    """vLLM's server on the shipped demo model: fp32, MTP with k = 3, PP 1, eager."""
    server = start_or_fail(lambda: VllmServer(DEMO_DIR, K, eager=True))
    yield server
    server.stop()
