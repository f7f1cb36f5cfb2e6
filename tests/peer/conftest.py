"""Fixtures of the peer suite: the vLLM environment and its servers. A peer that cannot be installed or
started fails the suite with one line; it is never skipped."""

from __future__ import annotations

import pytest

from specdoctor.runtime.checkpoint.files import DEMO_DIR, DEMO_DRAFTERS, DEMO_MODELS
from tests.helpers.draft_models import save_cut_down
from tests.helpers.reasoning import save_thinking_demo
from tests.peer.vllm_env import PeerUnavailable, ensure_vllm
from tests.peer.vllm_server import VllmServer

K = 3  # draft tokens per step, on both engines
REASONING = ("--reasoning-parser", "hf")  # vLLM's, and serve's, parser of the checkpoint's response_template


def start_or_fail(factory):
    try:
        return factory()
    except PeerUnavailable as err:
        pytest.fail(f"peer suite: {err}", pytrace=False)


@pytest.fixture(scope="session")
def vllm_python():
    return start_or_fail(ensure_vllm)


@pytest.fixture(scope="session")
def thinking_demo(tmp_path_factory):
    """The demo as a reasoning model's checkpoint (tests/helpers/reasoning.py): its weights, with a chat template
    that opens its thinking and the response_template that names what closes it."""
    return save_thinking_demo(tmp_path_factory.mktemp("peer") / "demo")


@pytest.fixture(scope="session")
def vllm_demo(vllm_python, thinking_demo):
    """vLLM's server on the demo model: fp32, MTP with k = 3, PP 1, eager; its reasoning parser reads the
    response_template (chat replies only: a completion is constrained from its first token)."""
    server = start_or_fail(lambda: VllmServer(thinking_demo, K, eager=True, extra_args=REASONING))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_demo_plain(vllm_python, thinking_demo):
    """The same server without speculation: the reference the probe's sweeps compare vLLM's speculation with."""
    server = start_or_fail(lambda: VllmServer(thinking_demo, 0, eager=True, extra_args=REASONING))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_demo_tp2(vllm_python):
    """vLLM's server on the demo at TP 2: two CPU workers, each bound to a core."""
    server = start_or_fail(lambda: VllmServer(DEMO_DIR, K, eager=True, tp=2))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def demo_draft_model(tmp_path_factory):
    """demo-dspark's target cut to its first two of six layers by transformers: a draft model for it."""
    return save_cut_down(DEMO_MODELS["demo-dspark"], tmp_path_factory.mktemp("peer") / "draft", num_hidden_layers=2)


def drafter_server(model: str, drafter: dict):
    """vLLM's server on a demo target with a drafter checkpoint of its own: fp32, k = 3, PP 1, eager."""
    server = start_or_fail(lambda: VllmServer(DEMO_MODELS[model], K, eager=True, drafter=drafter))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_eagle3(vllm_python):
    """demo-eagle3: demo-dspark's target with its trained EAGLE-3 head."""
    yield from drafter_server("demo-eagle3", {"method": "eagle3", "model": str(DEMO_DRAFTERS["demo-eagle3"])})


@pytest.fixture(scope="module")
def vllm_draft_model(vllm_python, demo_draft_model):
    yield from drafter_server("demo-dspark", {"method": "draft_model", "model": str(demo_draft_model)})
