"""Each demo module's prompts and one-process results, for the demo its `DEMO` names."""

from __future__ import annotations

import pytest

from tests.demos.test_demo_runtime import demo_prompts, one_process


@pytest.fixture(scope="module")
def prompts(request):
    return demo_prompts(request.module.DEMO)


@pytest.fixture(scope="module")
def single_process(request, prompts):
    """PP = 1 in this process: plain greedy tokens (k = 0) and the speculative results for k = 1..5."""
    return one_process(request.module.DEMO, prompts)
