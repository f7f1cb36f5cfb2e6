"""`--timeout` bounds a peer that is stuck, not one that is working: a rank held loading for longer than the timeout is
waited for (its beat goes on), a rank stopped while loading is named once its beat has been still for the timeout."""

from __future__ import annotations

import functools
import os
import time

import pytest

from specdoctor.errors import PipelineError
from specdoctor.runtime import engine as engine_module
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from tests.helpers.held_ranks import held_rank_main

TIMEOUT_S = 3.0


def test_a_rank_loading_longer_than_the_timeout_is_waited_for(monkeypatch, tmp_path):
    held = functools.partial(held_rank_main, 1, 3 * TIMEOUT_S, str(tmp_path / "pid"))
    monkeypatch.setattr(engine_module, "rank_main", held)
    started = time.monotonic()
    with Engine(RuntimeOptions("demo", pp=2, num_speculative_tokens=3, timeout=TIMEOUT_S)) as engine:
        assert time.monotonic() - started >= 3 * TIMEOUT_S  # rank 0 waited, and did not time out
        result = engine.generate([[5, 6, 7]], 8, num_speculative_tokens=3)
    assert len(result.tokens[0]) == 8


def test_a_rank_stopped_while_loading_is_named_within_the_timeout(monkeypatch, tmp_path):
    monkeypatch.setattr(engine_module, "rank_main", functools.partial(held_rank_main, 1, "stop", str(tmp_path / "pid")))
    started = time.monotonic()
    with pytest.raises(PipelineError, match=r"rank 1 made no progress for \d+ s while loading its shard") as caught:
        Engine(RuntimeOptions("demo", pp=2, num_speculative_tokens=3, timeout=TIMEOUT_S))
    assert time.monotonic() - started < 30, caught.value
    with pytest.raises(ProcessLookupError):  # the engine killed its ranks, the stopped one too
        os.kill(int((tmp_path / "pid").read_text()), 0)
