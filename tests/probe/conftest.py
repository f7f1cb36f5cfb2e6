"""The servers the probe tests point at: real `specdoctor serve` processes on loopback, started once."""

from __future__ import annotations

import pytest

from tests.helpers.reasoning import save_thinking_demo
from tests.helpers.servers import SpecdoctorServer as Server

DUMMY_PAST = 1024  # the faulty server's drafter-max-position: under the demo's 2,048-token context
FAULTS = (
    f"drafter-max-position={DUMMY_PAST}",
    "stale-batch-rows",
    "rejection-reuse-uniform",
)  # sampling-params-ignored has a server of its own (test_sweeps.py): this one's rejection-reuse-uniform masks it


@pytest.fixture(scope="package")
def thinking_demo(tmp_path_factory):
    """The demo as a reasoning model's checkpoint (tests/helpers/reasoning.py): the healthy server and the
    reference serve it with their reasoning parser on, so the API sweep's schema after a reasoning runs."""
    return save_thinking_demo(tmp_path_factory.mktemp("probe") / "demo")


@pytest.fixture(scope="package")
def servers(thinking_demo):
    reasoning = ("--reasoning-parser", "hf")
    started = {
        "healthy": Server("--pp", "2", "--num-speculative-tokens", "3", *reasoning, model=str(thinking_demo)),
        # "stale": the unloaded embedding holds another weight's bytes, as a caching allocator's reused
        # block would; unlike "empty" it is the same on every run.
        "broken": Server("--pp", "2", "--drafter-policy", "engine-legacy", "--fill", "stale", "--allow-unhealthy"),
        "off": Server("--num-speculative-tokens", "0", *reasoning, model=str(thinking_demo)),
        # Every fault a sweep exists to find, at once: each touches only its own sweep's traffic (long prompts,
        # concurrent requests, sampled ones), which the healthy server's passing sweeps show.
        "faulty": Server("--pp", "2", "--fault", ",".join(FAULTS), "--allow-unhealthy"),
    }
    yield started
    for server in started.values():
        server.stop()
