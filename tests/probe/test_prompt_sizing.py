"""The prefix-cache sweep's prompt lengths, searched try by try as the server counts them (`CutSearch`): here the
demo's tokenizer (transformers) counts, and refuses a prompt past a 512-token room, as vLLM's test deployment
does."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specdoctor.probe.acceptance_sweeps import (
    CALIBRATION_CHARS,
    CALIBRATION_STARTS,
    PREFIX_FIRST_CUT,
    PREFIX_MAX_PROMPTS,
    PREFIX_MAX_TOKENS,
    PREFIX_ROOM,
    PREFIX_TOLERANCE,
    PREFIX_TRIES,
    CutSearch,
)
from specdoctor.probe.corpus import STARTS, corpus_prompt
from specdoctor.runtime.checkpoint.files import DEMO_DIR

ROOM = 512  # vLLM's test deployment's max_model_len
TOKENS = int((ROOM - PREFIX_MAX_TOKENS) * PREFIX_ROOM)  # the longest aim the sweep takes there


@pytest.fixture(scope="module")
def count():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR)
    return lambda text: len(tokenizer(text)["input_ids"])


def test_every_stretch_of_the_corpus_is_cut_within_the_tolerance_under_its_aim(count):
    """Every prompt a sweep can send (all PREFIX_MAX_PROMPTS places, three prompt seeds), from the first cut at the
    corpus' mean density: within PREFIX_TRIES tries each ends between the tolerance and the aim, though some tries
    run past the room (a stretch's tail far denser than its head) and are refused."""
    step = STARTS // CALIBRATION_STARTS
    calibration = "".join(corpus_prompt(i * step, CALIBRATION_CHARS) for i in range(CALIBRATION_STARTS))
    per_token = len(calibration) / count(calibration)
    refused, tries = 0, []
    for seed in (0, 1, 11):
        for i in range(PREFIX_MAX_PROMPTS):
            search, tries = CutSearch(TOKENS, int(TOKENS * per_token * PREFIX_FIRST_CUT)), [*tries, 0]
            for _ in range(PREFIX_TRIES):
                counted = count(f"# 0123456789abcdef {i}\n" + corpus_prompt(i, search.chars, seed))
                refused += counted > ROOM
                search.tried(counted if counted <= ROOM else None, "too long")
                tries[-1] += 1
                if search.done:
                    break
            assert search.done, (seed, i, search.under, search.over)
            assert (1 - PREFIX_TOLERANCE) * TOKENS <= search.under[1] <= TOKENS
    assert refused > 0  # dense tails are among them
    assert max(tries) <= PREFIX_TRIES and sum(tries) / len(tries) < 2.5, tries


def test_a_refused_first_try_is_cut_until_the_server_takes_it():
    search = CutSearch(100, 1000)
    search.tried(None, "answered 400: too long")
    assert search.chars == 500 and search.under is None and search.error == "answered 400: too long"
    search.tried(60)  # under the aim: the next cut lies between the two tries, by their counts
    assert search.under == (500, 60) and 500 < search.chars < 1000 and not search.done
    search.tried(93)
    assert search.done and search.under == (search.under[0], 93)
