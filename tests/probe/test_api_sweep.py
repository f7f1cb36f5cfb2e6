"""`probe --api` against real `specdoctor serve` processes: the request API under speculation passes on a healthy
server, with and without a reference; each output fault fails the check of its class; the decision functions at
their edges."""

from __future__ import annotations

import json

import pytest

from specdoctor.probe.api_common import as_completion, cut_mismatch, tie_before
from specdoctor.probe.api_output_checks import stop_at
from specdoctor.probe.api_structured_checks import (
    CONSTRAINTS,
    REASONED,
    ignored,
    judgeable,
    structured_mismatch,
    uncomparable,
)
from specdoctor.probe.output_sweeps import TIE_MARGIN, output_ids
from tests.helpers.servers import SpecdoctorServer as Server
from tests.helpers.servers import probe

OUTPUT_FAULTS = "stop-in-draft-missed,eos-leak-past-max-tokens,logprobs-of-draft"
ALL_CHECKS = [
    "max_tokens mid-run",
    "stop strings",
    "stop token ids",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "logit_bias",
    "presence_penalty 1.5",
    "frequency_penalty 1",
    "repetition_penalty 1.5",
    "response_format json_schema",
    "response_format json_object",
    "structured_outputs regex",
    "structured_outputs choice",
    "json_schema after reasoning",
    "seed",
]
STRUCTURED = [name for name in ALL_CHECKS if name.startswith(("response_format", "structured_outputs"))]
WHITESPACE = "response_format json_object"  # the demo writes whitespace to the limit: no reply to judge, not run
# the healthy server and the reference serve the demo as a reasoning checkpoint with their parser on (conftest.py);
# the fault servers serve the demo itself, whose chat replies carry no reasoning: not run there
NO_REASONING = "json_schema after reasoning"


def api_checks(result) -> dict[str, dict]:
    (api,) = [sweep for sweep in json.loads(result.stdout)["sweeps"] if sweep["name"] == "api"]
    return {point["label"]: point for point in api["points"]}


@pytest.fixture(scope="module")
def output_faults():
    """The output faults at once: one touches stops inside a run, one the run that crosses max_tokens (the stop
    token ids the sweep chooses lie well inside its 48 tokens), one the log-probabilities reported for drafts."""
    server = Server("--pp", "2", "--num-speculative-tokens", "3", "--fault", OUTPUT_FAULTS, "--allow-unhealthy")
    yield server
    server.stop()


@pytest.mark.parametrize("reference", [False, True], ids=["own-output", "reference"])
def test_a_healthy_server_passes_every_api_check(servers, reference):
    """Every field the sweep sends is implemented by `serve` at k 3 as at k 0 (the reference), structured output
    included; without a reference the repetition penalty is not verified (it scales logits, which log-probabilities
    do not show), and says that it changed the outputs."""
    args = ("--reference-url", servers["off"].url) if reference else ()
    result = probe(servers["healthy"].url, "--api", *args, "--json", "-")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    checks = api_checks(result)
    unverified = [WHITESPACE] + ([] if reference else ["repetition_penalty 1.5"])
    verdicts = {name: check["verdict"] for name, check in checks.items()}
    assert verdicts == {name: "not run" if name in unverified else "passed" for name in ALL_CHECKS}
    assert all(checks[name]["requests"] >= 3 for name in ALL_CHECKS)
    assert checks["presence_penalty 1.5"]["requests"] == 9  # every battery prompt
    assert checks["logprobs"]["requests"] > 3  # the positions sent again as prompts
    assert "no reply finished within 64 tokens" in checks[WHITESPACE]["evidence"]
    report = json.loads(result.stdout)
    warnings = [f["message"] for f in report["findings"] if f["severity"] == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith("not verified: ")
    assert all(name in warnings[0] for name in unverified)
    assert reference or "changed 3 of 3 outputs" in checks["repetition_penalty 1.5"]["evidence"]
    against = "(speculation off)" if reference else "against its own plain output"
    assert against in report["sweeps"][-1]["summary"]


@pytest.fixture(scope="module")
def logit_faults():
    """Two faults on the target's logits that touch different requests: the penalties (the sweep pins them neutral
    elsewhere) and the grammar's masks (only structured requests have one)."""
    faults = "penalties-per-step,grammar-no-rollback"
    server = Server("--pp", "2", "--num-speculative-tokens", "3", "--fault", faults, "--allow-unhealthy")
    yield server
    server.stop()


@pytest.mark.parametrize("reference", [False, True], ids=["own-output", "reference"])
def test_penalties_per_step_and_a_grammar_not_rolled_back_fail_the_checks_of_their_class(
    logit_faults, servers, reference
):
    """A server that counts a step's accepted drafts in no penalty (penalties-per-step): its penalised outputs leave
    speculation off's where a token repeats inside an accepted run (2 to 4 of the 9 prompts). Without a reference
    the presence and frequency penalties are found on the replies' own raw log-probabilities, and with one. Its
    grammar matchers stay where a step's rejected drafts left them (grammar-no-rollback): replies that break their
    schema or regex, found with or without a reference."""
    args = ("--reference-url", servers["off"].url) if reference else ()
    result = probe(logit_faults.url, "--api", *args, "--json", "-")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    checks = api_checks(result)
    failing = ["presence_penalty 1.5", "frequency_penalty 1"]
    verdicts = {name: check["verdict"] for name, check in checks.items()}
    structured = {name: verdicts.pop(name) for name in STRUCTURED}
    expected = {name: "failed" if name in failing else "passed" for name in ALL_CHECKS if name not in STRUCTURED}
    # repetition: without a reference it needs one; with one, the replies part from speculation off (2 of 9) at
    # tokens it scales, whose scores log-probabilities do not show: not decided, and said
    assert not reference or "parts from speculation off" in checks["repetition_penalty 1.5"]["evidence"]
    assert verdicts == expected | {"repetition_penalty 1.5": "not run", NO_REASONING: "not run"}
    assert "no chat reply carries a reasoning" in checks[NO_REASONING]["evidence"]  # the demo itself: no parser
    # the schema's and the regex's replies break them (an invalid draft's state masks the token after it)
    assert structured["response_format json_schema"] == structured["structured_outputs regex"] == "failed"
    assert "does not match" in checks["structured_outputs regex"]["evidence"]
    broken = [name for name in STRUCTURED if structured[name] == "failed"]
    errors = [f for f in json.loads(result.stdout)["findings"] if f["severity"] == "error"]
    assert [f["message"].split(":")[0] for f in errors] == failing + broken
    assert all("per accepted token" in f["hint"] for f in errors[:2])
    assert all("bitmask meets the drafts" in f["hint"] for f in errors[2:])


@pytest.mark.parametrize("reference", [False, True], ids=["own-output", "reference"])
def test_each_output_fault_fails_the_check_of_its_class(output_faults, servers, reference):
    args = ("--reference-url", servers["off"].url) if reference else ()
    result = probe(output_faults.url, "--api", *args, "--json", "-")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr
    checks = api_checks(result)
    assert (
        checks["max_tokens mid-run"]["verdict"] == "failed"
        and "past the cut" in checks["max_tokens mid-run"]["evidence"]
    )
    assert checks["stop token ids"]["verdict"] == "failed"
    # the drafter's distribution reported for a draft: not the target's (speculation off's), and a rejected
    # draft's recovered token is not its top entry
    assert checks["logprobs"]["verdict"] == "failed"
    # none touches these: a stop string is cut from the text, and a seeded reply is not cut
    assert [checks[name]["verdict"] for name in ("stop strings", "seed")] == ["passed"] * 2
    report = json.loads(result.stdout)
    # (with a reference, the reference sweep fails too: the battery's greedy output runs on past an end-of-sequence
    # token accepted inside a run)
    errors = [f for f in report["findings"] if f["severity"] == "error" and f["check"] == "probe.api"]
    named = [f["message"].split(":")[0] for f in errors]
    # with a reference, min_tokens and the penalties too: their replies run past a stop id accepted inside a run, or
    # past 48 tokens, where speculation off's end (the evidence names the token)
    # the prompt pass's log-probabilities are the target's: the drafter's reported for drafts differ from them too
    due = ["max_tokens mid-run", "stop token ids", "logprobs", "prompt_logprobs"]
    assert set(due) <= set(named) if reference else named == due
    assert all(f["hint"] for f in errors)


def reply(ids: list[int], finish: str, tops: list[dict] | None = None, usage: int | None = None) -> dict:
    logprobs = {"tokens": [f"token_id:{t}" for t in ids], "top_logprobs": tops or [{} for _ in ids]}
    body = {"choices": [{"token_ids": ids, "finish_reason": finish, "logprobs": logprobs, "text": ""}]}
    return body | ({"usage": {"completion_tokens": usage}} if usage is not None else {})


def test_a_cut_is_exactly_the_plain_outputs_first_tokens_with_its_finish_reason():
    plain = reply([5, 6, 7, 8, 9], "length")
    assert cut_mismatch(reply([5, 6, 7], "length", usage=3), plain, 3, "length") is None
    assert (
        cut_mismatch(reply([5, 6, 7, 8], "length"), plain, 3, "length") == "4 tokens where 3 were due (1 past the cut)"
    )
    assert (
        cut_mismatch(reply([5, 9, 7], "length"), plain, 3, "length")
        == "3 tokens where 3 were due (not the plain output's)"
    )
    assert cut_mismatch(reply([5, 6], "length"), plain, 3, "length") == "2 tokens where 3 were due (cut early)"
    assert "finish_reason 'stop'" in cut_mismatch(reply([5, 6, 7], "stop"), plain, 3, "length")
    assert "usage counts 4" in cut_mismatch(reply([5, 6, 7], "length", usage=4), plain, 3, "length")
    # a stop id may be kept as one more token (vLLM keeps it), never two
    assert cut_mismatch(reply([5, 6, 7, 8], "stop"), plain, 3, "stop") is None
    assert cut_mismatch(reply([5, 6, 7, 8, 9], "stop"), plain, 3, "stop") is not None


def test_a_difference_at_a_near_tie_of_the_plain_output_is_numerics():
    at_tie = [{}, {"token_id:6": -0.5, "token_id:4": -0.5 - TIE_MARGIN}, {}]
    past_tie = [{}, {"token_id:6": -0.5, "token_id:4": -0.5 - TIE_MARGIN - 0.01}, {}]
    assert tie_before(reply([5, 4, 1], "length"), reply([5, 6, 7], "length", at_tie), 3)
    assert not tie_before(reply([5, 4, 1], "length"), reply([5, 6, 7], "length", past_tie), 3)
    assert not tie_before(reply([5, 4, 1], "length"), reply([5, 6, 7], "length", at_tie), 1)  # past the cut
    assert cut_mismatch(reply([5, 4], "length"), reply([5, 6, 7], "length", at_tie), 2, "length") is None


def test_a_stop_string_begins_where_it_is_first_found():
    assert stop_at("abcdabcdXYZW tail", 0.0) == ("abcd", 0)
    assert stop_at("abcdabcdXYZW tail", 0.25) == ("bcdX", 5)  # "abcd" at 4 occurs earlier: skipped
    assert stop_at("    abc", 0.0) == ("   a", 1)  # whitespace alone is no stop string
    assert stop_at("abcdabcd", 0.5) is None  # nothing at or after the middle occurs first there


@pytest.mark.parametrize(
    "text, finish, wrong",
    [
        ('{"ok": true, "tag": "red", "n": 3}', "stop", None),
        ('{"ok": 1, "tag": "red", "n": 3}', "stop", "1 is not of type boolean"),
        ('{"ok": true, "tag": "pink", "n": 3}', "stop", "'pink' is not one of"),
        ('{"ok": true, "tag": "red", "n": true}', "stop", "True is not of type integer"),  # JSON's true is no integer
        ('{"ok": true, "tag": "red"}', "stop", "properties missing ['n']"),
        ('{"ok": true, "tag": "red", "n": 3, "x": 0}', "stop", "not allowed ['x']"),
        ('{"ok": true, "tag"', "stop", "not JSON"),
        ('{"ok": true, "tag"', "length", None),  # cut by max_tokens: not judged
    ],
)
def test_a_finished_structured_reply_is_json_valid_against_its_schema(text, finish, wrong):
    schema, json_object, regex, choice = CONSTRAINTS
    found = structured_mismatch({"choices": [{"text": text, "finish_reason": finish}]}, schema)
    assert found == wrong if wrong is None else wrong in found
    if finish == "stop" and wrong is None:  # json_object asks for JSON alone
        assert structured_mismatch({"choices": [{"text": "[1, 2]", "finish_reason": "stop"}]}, json_object) is None
        assert regex.breach("yes, 12.") is None and regex.breach("yes, 12. ") is not None
        assert choice.breach("gamma delta") is None and choice.breach("gamma") is not None


def test_a_chat_reply_is_judged_on_its_content_once_its_reasoning_ended():
    """A chat reply read in the completions' shape: the content is the text, the reasoning beside it, the
    log-probability entries as parallel lists. One that finished inside its reasoning is not judged; one whose
    reasoning ended is judged on its content alone."""
    top = [{"token": "token_id:7", "logprob": -0.1}, {"token": "token_id:9", "logprob": -2.5}]
    entries = {"content": [{"token": "token_id:7", "logprob": -0.1, "top_logprobs": top}]}
    message = {"role": "assistant", "reasoning": "first, think", "content": '{"ok": true, "tag": "red", "n": 3}'}
    chat = {"choices": [{"message": message, "token_ids": [7], "finish_reason": "stop", "logprobs": entries}]}
    shaped = as_completion(chat)["choices"][0]
    assert shaped["text"] == message["content"] and shaped["reasoning"] == "first, think"
    assert shaped["logprobs"]["top_logprobs"] == [{"token_id:7": -0.1, "token_id:9": -2.5}]
    assert output_ids(as_completion(chat)) == [7]
    assert judgeable(as_completion(chat)) and structured_mismatch(as_completion(chat), REASONED) is None
    broken = {**chat, "choices": [{**chat["choices"][0], "message": {**message, "content": ' the {"ok"'}}]}
    assert "not JSON" in structured_mismatch(as_completion(broken), REASONED)
    thinking = {**chat, "choices": [{**chat["choices"][0], "message": {**message, "content": None}}]}
    assert not judgeable(as_completion(thinking)) and structured_mismatch(as_completion(thinking), REASONED) is None
    # an end-of-sequence token first, inside the reasoning: nothing at all, not judged either
    empty = {**chat, "choices": [{**chat["choices"][0], "message": {"role": "assistant", "content": None}}]}
    assert not judgeable(as_completion(empty))
    # a reference that splits no reasoning ran its grammar from the first token: its replies are not compared
    unsplit = {"role": "assistant", "content": ' first, think{"ok": true}'}
    plain_reference = [as_completion({"choices": [{**chat["choices"][0], "message": unsplit}]}), as_completion(empty)]
    assert dict(uncomparable(plain_reference, chat=True))["the reference splits no reasoning from its replies"]
    assert not any(holds for _, holds in uncomparable([as_completion(chat)], chat=True))


def test_a_field_the_server_ignores_is_told_from_a_broken_one():
    """Every reply breaking the constraint and beginning as the reply without it: the field was not read (not run);
    one reply that differs from the unconstrained one: the server read it and broke it (judged)."""
    regex = CONSTRAINTS[2]
    free = [{"choices": [{"text": text}]} for text in ("def f(x):", "import os")]
    same = [{"choices": [{"text": text}]} for text in ("def f(x):\n    return", "import")]
    assert ignored(same, free, regex)
    assert not ignored([same[0], {"choices": [{"text": "yes,, 9."}]}], free, regex)
    assert not ignored([same[0], {"choices": [{"text": "no, 7."}]}], free, regex)  # one follows it
