"""`probe --api` against real `specdoctor serve` processes: the request API under speculation passes on a healthy
server, with and without a reference; each output fault fails the check of its class; the decision functions at
their edges."""

from __future__ import annotations

import json

import pytest

from specdoctor.probe.api_sweep import TIE_MARGIN, cut_mismatch, stop_at, tie_before
from tests.helpers.servers import SpecdoctorServer as Server
from tests.helpers.servers import probe

OUTPUT_FAULTS = "stop-in-draft-missed,eos-leak-past-max-tokens"


def api_checks(result) -> dict[str, dict]:
    (api,) = [sweep for sweep in json.loads(result.stdout)["sweeps"] if sweep["name"] == "api"]
    return {point["label"]: point for point in api["points"]}


@pytest.fixture(scope="module")
def output_faults():
    """Both output faults at once: the one touches stops inside a run, the other the run that crosses max_tokens
    (the stop token ids the sweep chooses lie well inside its 48 tokens)."""
    server = Server("--pp", "2", "--num-speculative-tokens", "3", "--fault", OUTPUT_FAULTS, "--allow-unhealthy")
    yield server
    server.stop()


@pytest.mark.parametrize("reference", [False, True], ids=["own-output", "reference"])
def test_a_healthy_server_passes_every_api_check_it_implements_and_says_which_it_refuses(servers, reference):
    args = ("--reference-url", servers["off"].url) if reference else ()
    result = probe(servers["healthy"].url, "--api", *args, "--json", "-")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    checks = api_checks(result)
    implemented = ["max_tokens mid-run", "stop strings", "stop token ids", "logprobs", "seed"]
    assert {name: checks[name]["verdict"] for name in implemented} == dict.fromkeys(implemented, "passed")
    assert all(checks[name]["requests"] >= 3 for name in implemented)
    refused = [name for name, check in checks.items() if name not in implemented]
    assert refused == ["logit_bias", "presence_penalty 1.5", "frequency_penalty 1", "repetition_penalty 1.5"]
    assert all("not implemented by specdoctor serve" in checks[name]["evidence"] for name in refused)
    assert all(checks[name]["verdict"] == "not run" for name in refused)
    report = json.loads(result.stdout)
    warnings = [f["message"] for f in report["findings"] if f["severity"] == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith("not verified: logit_bias")
    against = "(speculation off)" if reference else "against its own plain output"
    assert against in report["sweeps"][-1]["summary"]


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
    # neither fault touches the others: a stop string is cut from the text, and a 48-token reply is not cut
    assert [checks[name]["verdict"] for name in ("stop strings", "logprobs", "seed")] == ["passed"] * 3
    report = json.loads(result.stdout)
    # (with a reference, the reference sweep fails too: the battery's greedy output runs on past an end-of-sequence
    # token accepted inside a run)
    errors = [f for f in report["findings"] if f["severity"] == "error" and f["check"] == "probe.api"]
    assert [f["message"].split(":")[0] for f in errors] == ["max_tokens mid-run", "stop token ids"]
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
