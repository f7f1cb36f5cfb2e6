"""`serve --reasoning-parser hf` on the demo as a reasoning checkpoint written by transformers (the package's
healthy server at PP 2, k 3, and its reference at k 0: tests/probe/conftest.py): each chat reply split where
transformers' own parser splits it, structured output starting after the reasoning, inside a step's drafts as after
plain decoding, whole and streamed, completions too where their prompt opens the thinking; `probe --api` fails the
fault that leaves the positions after the reasoning's end unmasked (vllm#44006). (The healthy server passing the
check: tests/probe/test_api_sweep.py.)"""

from __future__ import annotations

import json

import httpx
import pytest

from specdoctor.probe.api_structured_checks import SCHEMA, schema_violation
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from tests.helpers.servers import SpecdoctorServer as Server
from tests.helpers.servers import probe

BATTERY = [json.loads(line)["prompt"] for line in (DEMO_DIR.parent / "battery.jsonl").read_text().splitlines()]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "probe", "schema": SCHEMA}}
REASONED = "json_schema after reasoning"


@pytest.fixture(scope="module")
def unmasked(thinking_demo):
    flags = ("--num-speculative-tokens", "3", "--reasoning-parser", "hf", "--fault", "reasoning-end-unmasked")
    server = Server(*flags, "--allow-unhealthy", model=str(thinking_demo))
    yield server
    server.stop()


def chat_body(prompt: str, **fields) -> dict:
    """A greedy chat request of the prompt under the schema, 64 tokens."""
    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 64}
    return body | {"response_format": SCHEMA_FORMAT, **fields}


def chat(url: str, prompt: str, **fields) -> dict:
    body = chat_body(prompt, return_token_ids=True, **fields)
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def streamed(url: str, prompt: str) -> tuple[str, str | None]:
    """The stream's reasoning and content deltas, each joined (content None where no delta carried any)."""
    body = chat_body(prompt, stream=True)
    reasoning, content = [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                reasoning.append(delta.get("reasoning") or "")
                if delta.get("content") is not None:
                    content.append(delta["content"])
    return "".join(reasoning), "".join(content) if content else None


def test_each_reply_splits_as_transformers_parses_it_and_its_schema_starts_after_the_reasoning(servers, thinking_demo):
    """At PP 2, k 3 every battery prompt's reply is plain decoding's (PP 1, k 0), token for token; its reasoning and
    content are what transformers' parse_response makes of its text after the prompt (but the whitespace it strips);
    a finished reply's content is valid against the schema, and the stream's deltas join to the whole reply."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking_demo)
    ended = finished = 0
    for prompt in BATTERY:
        spec, plain = chat(servers["healthy"].url, prompt), chat(servers["off"].url, prompt)
        assert spec["token_ids"] == plain["token_ids"], prompt
        message = spec["message"]
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        # transformers' parser strips each field's whitespace, vLLM's keeps it (the peer suite compares the bytes)
        text = tokenizer.decode(spec["token_ids"], skip_special_tokens=True)
        parsed = tokenizer.parse_response(text, prefix=rendered)
        split = [None if field is None else field.strip() for field in (message["reasoning"], message["content"])]
        assert split == [parsed.get("thinking"), parsed.get("content")], prompt
        assert streamed(servers["healthy"].url, prompt) == (message["reasoning"] or "", message["content"])
        ended += message["content"] is not None
        if message["content"] is not None and spec["finish_reason"] == "stop":
            finished += 1
            assert schema_violation(json.loads(message["content"]), SCHEMA) is None, message
    # the keywords end most replies' thinking; two finish their object within 64 tokens
    assert ended >= 5 and finished >= 2, (ended, finished)


def test_a_completion_waits_for_the_reasoning_only_where_its_prompt_opens_one(servers, thinking_demo):
    """vLLM asks every request's prompt whether it ended the reasoning: a completion of a code prompt is constrained
    from its first token; one whose prompt is the rendered chat turn, thinking open, gives the chat reply's tokens."""
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(thinking_demo).apply_chat_template(
        [{"role": "user", "content": BATTERY[0]}], add_generation_prompt=True, tokenize=False
    )
    url = servers["healthy"].url
    body = {"model": "demo", "max_tokens": 64, "temperature": 0, "return_token_ids": True}
    body["structured_outputs"] = {"json": SCHEMA}

    def completion(prompt: str) -> dict:
        return httpx.post(f"{url}/v1/completions", json=body | {"prompt": prompt}, timeout=120).json()["choices"][0]

    assert completion(BATTERY[0])["text"].lstrip().startswith("{")
    waited = completion(rendered)
    assert not waited["text"].lstrip().startswith("{") and waited["token_ids"] == chat(url, BATTERY[0])["token_ids"]


def test_unmasked_positions_after_the_reasonings_end_fail_the_check_against_a_reference(unmasked, servers):
    """With the positions after a reasoning's end inside a step left unmasked, a reply's first content token is the
    target's free choice: it parts from speculation off (k 0, the reference), and the check fails naming its class.
    (Without a reference the demo's free choice is whitespace, which JSON allows: only the reference sees it.)"""
    result = probe(unmasked.url, "--api", "--reference-url", servers["off"].url, "--json", "-")
    check = reasoned_check(result)
    assert check["verdict"] == "failed" and result.returncode == 1, check
    assert "against speculation off: the replies part at token" in check["evidence"]
    errors = [f for f in json.loads(result.stdout)["findings"] if f["severity"] == "error"]
    assert [f["message"].split(":")[0] for f in errors] == [REASONED] and "reasoning" in errors[0]["hint"]


def reasoned_check(result) -> dict:
    (api,) = [sweep for sweep in json.loads(result.stdout)["sweeps"] if sweep["name"] == "api"]
    return {point["label"]: point for point in api["points"]}[REASONED]
