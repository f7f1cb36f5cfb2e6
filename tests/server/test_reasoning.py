"""`serve --reasoning-parser hf` on a reasoning checkpoint written by transformers (tests/helpers/reasoning.py): each
chat reply split where transformers' own parser splits it, structured output starting after the reasoning, inside a
step's drafts as after plain decoding, whole and streamed; `probe --api` passes it and fails the fault that leaves
the positions after the reasoning's end unmasked (vllm#44006); a checkpoint without the template is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from specdoctor.errors import SpecdoctorError
from specdoctor.probe.api_structured_checks import SCHEMA, schema_violation
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from specdoctor.runtime.checkpoint.tokenizer import TOKENIZER_FILE, TextCodec
from specdoctor.server.reasoning import reasoning_template
from tests.helpers.reasoning import CLOSES, RESPONSE_TEMPLATE, save_thinking_demo
from tests.helpers.servers import SpecdoctorServer as Server
from tests.helpers.servers import probe

BATTERY = [json.loads(line)["prompt"] for line in (DEMO_DIR.parent / "battery.jsonl").read_text().splitlines()]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "probe", "schema": SCHEMA}}
REASONED = "json_schema after reasoning"


@pytest.fixture(scope="module")
def thinking_demo(tmp_path_factory):
    return save_thinking_demo(tmp_path_factory.mktemp("reasoning") / "demo")


@pytest.fixture(scope="module")
def servers(thinking_demo):
    parser = ("--reasoning-parser", "hf")
    fault = ("--fault", "reasoning-end-unmasked", "--allow-unhealthy")
    started = {}
    try:
        k3, k0 = ("--num-speculative-tokens", "3"), ("--num-speculative-tokens", "0")
        for name, args in (("k3", k3), ("k0", k0), ("unmasked", (*k3, *fault))):
            started[name] = Server(*args, *parser, model=str(thinking_demo))
        yield started
    finally:
        for server in started.values():
            server.stop()


def chat(url: str, prompt: str, **fields) -> dict:
    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 64}
    body |= {"response_format": SCHEMA_FORMAT, "return_token_ids": True, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def streamed(url: str, prompt: str) -> tuple[str, str | None]:
    """The stream's reasoning and content deltas, each joined (content None where no delta carried any)."""
    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 64}
    body |= {"response_format": SCHEMA_FORMAT, "stream": True}
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
    """At k 3 every battery prompt's reply is plain decoding's (k 0), token for token; its reasoning and content are
    what transformers' parse_response makes of its text after the prompt (but the whitespace it strips); a finished
    reply's content is valid against the schema, and the stream's deltas join to the whole reply."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking_demo)
    ended = finished = 0
    for prompt in BATTERY:
        spec, plain = chat(servers["k3"].url, prompt), chat(servers["k0"].url, prompt)
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
        assert streamed(servers["k3"].url, prompt) == (message["reasoning"] or "", message["content"])
        ended += message["content"] is not None
        if message["content"] is not None and spec["finish_reason"] == "stop":
            finished += 1
            assert schema_violation(json.loads(message["content"]), SCHEMA) is None, message
    # the keywords end most replies' thinking; two finish their object within 64 tokens
    assert ended >= 5 and finished >= 2, (ended, finished)


def test_completions_and_a_prompt_that_leaves_no_thinking_open_are_constrained_from_the_first_token(servers):
    """The template's thinking is a chat turn's: a completion is constrained from its first token, as vLLM's is."""
    body = {"model": "demo", "prompt": BATTERY[0], "max_tokens": 16, "temperature": 0}
    body["structured_outputs"] = {"json": SCHEMA}
    text = httpx.post(f"{servers['k3'].url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert text.lstrip().startswith("{"), text


def test_the_probe_passes_a_healthy_reasoning_server_and_fails_unmasked_positions_after_the_end(servers):
    """`probe --api` runs the schema after a reasoning: passed at k 3 on its own rules. With the positions after a
    reasoning's end inside a step left unmasked, a reply's first content token is the target's free choice: it
    parts from speculation off (k 0, the reference), and the check fails naming its class. (Without a reference the
    demo's free choice is whitespace, which JSON allows: only the reference sees it.)"""
    healthy = probe(servers["k3"].url, "--api", "--json", "-")
    unmasked = probe(servers["unmasked"].url, "--api", "--reference-url", servers["k0"].url, "--json", "-")
    checks = [reasoned_check(result) for result in (healthy, unmasked)]
    assert checks[0]["verdict"] == "passed" and healthy.returncode == 0, checks[0]
    assert checks[1]["verdict"] == "failed" and unmasked.returncode == 1, checks[1]
    assert "against speculation off: the replies part at token" in checks[1]["evidence"]
    errors = [f for f in json.loads(unmasked.stdout)["findings"] if f["severity"] == "error"]
    assert [f["message"].split(":")[0] for f in errors] == [REASONED] and "reasoning" in errors[0]["hint"]


def reasoned_check(result) -> dict:
    (api,) = [sweep for sweep in json.loads(result.stdout)["sweeps"] if sweep["name"] == "api"]
    return {point["label"]: point for point in api["points"]}[REASONED]


@pytest.mark.parametrize(
    "parser, model, said",
    [
        ("hf", "demo", "needs a response_template with a thinking field"),
        ("deepseek_r1", "demo", "--reasoning-parser 'deepseek_r1' is not implemented"),
    ],
)
def test_a_reasoning_parser_serve_cannot_run_is_refused_in_one_line(parser, model, said):
    result = subprocess.run(
        [sys.executable, "-m", "specdoctor", "serve", "--model", model, "--reasoning-parser", parser],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and said in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_template_reads_the_closes_tokens_and_splits_a_reply_at_the_first_close(thinking_demo):
    """The closes' tokens as vLLM finds them (each one token here); a prompt's last turn opens the
    thinking; a reply splits at its first close, and a stream holds back an end that could begin one."""
    codec = TextCodec(thinking_demo / TOKENIZER_FILE)
    template = reasoning_template("hf", thinking_demo, codec)
    assert [len(ids) for ids in template.end_ids] == [1] * len(CLOSES)
    assert [codec.decode(list(ids)) for ids in template.end_ids] == CLOSES
    assert template.open_after("user: x if y\nassistant:<think>")
    assert not template.open_after("user: x\nassistant:<think>a if")  # closed in the prompt
    assert not template.open_after("import os\n")  # a completion's prompt: no thinking opened
    assert template.split("a.b if {") == ("a.b", " {") and template.split("a.b") == ("a.b", None)
    assert template.split('x self y """') == ("x", ' y """')  # the first close, whichever it is
    assert template.settled("a.b i") == "a.b" and template.settled("a.b if x") == "a.b if x"


@pytest.mark.parametrize(
    "change, said",
    [
        ({"fields": {"content": {}}}, "needs a response_template with a thinking field"),
        (
            {"fields": {"thinking": {"open": "<think>", "close_pattern": "</think>\\s*"}, "content": {}}},
            "must be literal strings",
        ),
    ],
)
def test_a_template_serve_cannot_follow_is_refused_naming_the_file(tmp_path, thinking_demo, change, said):
    config = json.loads((thinking_demo / "tokenizer_config.json").read_text())
    config["response_template"] = RESPONSE_TEMPLATE | change
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SpecdoctorError, match=said) as refused:
        reasoning_template("hf", tmp_path, TextCodec(thinking_demo / TOKENIZER_FILE))
    assert str(tmp_path / "tokenizer_config.json") in str(refused.value)
