"""`specdoctor serve` over a real socket: the official openai client, streaming, 32 concurrent
clients, metrics, bad requests, a killed rank, and shutdown."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdoctor.runtime.checkpoint.files import DEMO_DIR
from specdoctor.server.protocol import PLAIN_CHAT_TEMPLATE, UNIMPLEMENTED_FIELDS, ChatMessage, render_chat
from tests.commands.test_cli import rename_key
from tests.helpers.servers import SpecdoctorServer as Server
from tests.helpers.servers import free_port
from tests.helpers.waiting import alive, wait_for

PROMPTS = ["def read_config(path):\n", "class Parser:\n    def __init__(self", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def server():
    server = Server("--pp", "2", "--num-speculative-tokens", "3", "--adaptive-speculation")  # serve's default
    yield server
    server.stop()
    assert server.process.returncode is not None

    def live_ranks() -> list[int]:
        return [pid for pid in server.rank_pids if alive(pid)]

    # SIGTERM stopped every rank (the server joins them before it exits; a rank left behind would wait out its
    # peers' 60 s timeout, far past this deadline).
    wait_for(live_ranks, lambda pids: pids == [], 10, "every rank to exit after the server's SIGTERM")


def generate_cli(prompts: list[str], max_tokens: int) -> list[str]:
    """What `specdoctor generate` prints for the same prompts (greedy, PP 2, k 3)."""
    args = [arg for prompt in prompts for arg in ("--prompt", prompt)]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specdoctor",
            "generate",
            "--model",
            "demo",
            "--pp",
            "2",
            "--num-speculative-tokens",
            "3",
            "--max-tokens",
            str(max_tokens),
            "--json",
            "-",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return [output["completion"] for output in json.loads(result.stdout)["outputs"]]


def test_openai_client_completes_chats_and_streams_like_generate(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert [model.id for model in client.models.list()] == ["demo"]
    chat_prompt = render_chat(PLAIN_CHAT_TEMPLATE, [ChatMessage(role="user", content="def main():")])
    expected = generate_cli([*PROMPTS, chat_prompt], 24)
    for prompt, text in zip(PROMPTS, expected, strict=False):
        completion = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0)
        assert completion.choices[0].text == text
        assert completion.usage.completion_tokens == 24
        stream = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == text
    messages = [{"role": "user", "content": "def main():"}]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == expected[-1]
    streamed = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=24, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == expected[-1]


def scrape(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if match := re.match(r"^(\S+?)(\{.*\})? (\S+)$", line):
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def gauge(url: str, name: str) -> float:
    return scrape(url)[f'vllm:{name}{{model_name="demo"}}']


def wait_for_gauge(url: str, name: str, value: float, what: str, timeout_s: float = 30) -> None:
    wait_for(lambda: gauge(url, name), lambda seen: seen == value, timeout_s, f"{what} ({name} = {value:g})")


def stream_completion(url: str, body: dict) -> tuple[str, str, dict]:
    """(text, finish reason, spec counters) of one streamed completion."""
    text, reason, spec = "", None, None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"]
                reason = chunk["choices"][0]["finish_reason"] or reason
                spec = chunk.get("spec_decode", spec)
    return text, reason, spec


def complete(url: str, body: dict) -> tuple[str, str]:
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    return choice["text"], choice["finish_reason"]


def soak_requests(url: str) -> list[dict]:
    """64 requests: lengths 4-35, greedy and seeded sampling, a third ending at a stop string taken
    from their own solo output, some at a stop token id."""
    requests = []
    for i in range(64):
        body = {"prompt": f"def function_{i}(value):\n    return", "max_tokens": 4 + i % 32, "temperature": 0}
        if i % 4 == 1:
            body.update(temperature=0.8, seed=i)
        if i % 8 == 2:
            body["stop_token_ids"] = [8]  # a frequent token of the demo's vocabulary
        requests.append(body)
    for body in requests[::3]:
        solo, _ = complete(url, body)
        if len(solo) > 6:
            body["stop"] = [solo[4:6]]
    return requests


def test_64_concurrent_streams_mixed_lengths_stops_and_sampling_match_their_solo_runs(server):
    requests = soak_requests(server.url)
    solo = [complete(server.url, body) for body in requests]
    before = scrape(server.url)
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda body: stream_completion(server.url, body), requests))
    after = scrape(server.url)
    assert [(text, reason) for text, reason, _ in results] == solo
    assert {reason for _, reason in solo} == {"stop", "length"}  # both endings occur
    assert sum("stop" in body for body in requests) > 15
    label = '{model_name="demo"}'
    for counter, field in [
        ("vllm:spec_decode_num_drafts_total", "num_drafts"),
        ("vllm:spec_decode_num_draft_tokens_total", "num_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens_total", "num_accepted_tokens"),
    ]:
        assert after[counter + label] - before[counter + label] == sum(spec[field] for *_, spec in results)
    position0 = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="demo",position="0"}'
    assert after[position0] - before[position0] == sum(s["num_accepted_tokens_per_pos"][0] for *_, s in results)
    ttft = 'vllm:time_to_first_token_seconds_count{model_name="demo"}'
    assert after[ttft] - before[ttft] == 64
    assert after['vllm:num_requests_running{model_name="demo"}'] == 0


def test_a_stop_string_cuts_the_text_and_ends_generation_at_once(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    stop = full[5:8]
    reply = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 1000, "stop": [stop]}, timeout=60)
    choice = reply.json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)] and choice["finish_reason"] == "stop"
    # The stop string lies within the first 24 tokens: the request ended there, not at max_tokens.
    assert reply.json()["usage"]["completion_tokens"] <= 24


def transformers_greedy(ids: list[int], tokens: int):
    """The oracle: transformers' own model class on the demo, fp32, decoding greedily itself; (the model, the
    completion's ids, their positions' log-probabilities [tokens, V])."""
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()
    sequence = list(ids)
    with torch.no_grad():
        for _ in range(tokens):
            sequence.append(int(reference(torch.tensor([sequence])).logits[0, -1].argmax()))
        logits = reference(torch.tensor([sequence])).logits[0, len(ids) - 1 : -1].log_softmax(-1)
    return reference, sequence[len(ids) :], logits


def test_logprobs_equal_transformers_and_stream_like_the_whole_reply(server):
    import torch

    ids = demo_tokens(PROMPTS[1])
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    reference, completion, logits = transformers_greedy(ids, 12)
    assert whole["tokens"] == [demo_codec().decode([token]) for token in completion]
    expected = logits.gather(-1, torch.tensor(completion)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(whole["token_logprobs"]), expected, atol=1e-4)
    top = logits.topk(3, dim=-1)
    for position, alternatives in enumerate(whole["top_logprobs"]):
        assert list(alternatives.values()) == pytest.approx(top.values[position].tolist(), abs=1e-4)
    assert whole["text_offset"][0] == 0 and len(whole["tokens"]) == 12
    streamed = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed == whole["token_logprobs"]
    # vLLM's prompt_logprobs: every prompt token from the second, its rank in the vocabulary, and the top 3, from the
    # prompt pass computed whole (no cached blocks), as transformers gives them
    asked = {**body, "max_tokens": 1, "prompt_logprobs": 3}
    shown = httpx.post(f"{server.url}/v1/completions", json=asked, timeout=60).json()["choices"][0]["prompt_logprobs"]
    with torch.no_grad():
        prompt = reference(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    assert shown[0] is None and len(shown) == len(ids)
    for position, (token, found) in enumerate(zip(ids[1:], shown[1:], strict=True)):
        mine = found[str(token)]
        assert mine["logprob"] == pytest.approx(float(prompt[position, token]), abs=1e-4)
        assert mine["rank"] == int((prompt[position] > prompt[position, token]).sum()) + 1
        best = prompt[position].topk(3)
        for rank, (alternative, value) in enumerate(zip(best.indices.tolist(), best.values.tolist(), strict=True), 1):
            assert found[str(alternative)] == {
                "logprob": pytest.approx(value, abs=1e-4),
                "rank": rank,
                "decoded_token": demo_codec().decode([alternative]),
            }
        assert len(found) == 3 + (mine["rank"] > 3)
    streamed_prompt = httpx.post(f"{server.url}/v1/completions", json={**asked, "stream": True}, timeout=60)
    assert streamed_prompt.status_code == 400 and streamed_prompt.json()["error"]["param"] == "prompt_logprobs"
    messages = [{"role": "user", "content": "def main():"}]
    chat = {"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    content = httpx.post(f"{server.url}/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 5 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert all(entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6 for entry in content)  # greedy: the best
    refused = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "logprobs": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"


def test_a_stop_token_id_is_the_last_token_id_counted_and_given_its_logprob_as_vllm_reports_it(server):
    """vLLM keeps the stop token id that ended a reply as the last of `token_ids`, counts it in
    `usage.completion_tokens` and reports its log-probability; its text is not the output's. Whole and streamed,
    against transformers' greedy output."""
    import torch

    ids = demo_tokens(PROMPTS[1])
    _, completion, logits = transformers_greedy(ids, 16)
    at = next(i for i in range(4, 16) if completion[i] not in completion[:i])  # a token's first occurrence
    stop = completion[at]
    body = {"prompt": ids, "max_tokens": 16, "temperature": 0, "logprobs": 1, "return_token_ids": True}
    body |= {"stop_token_ids": [stop], "ignore_eos": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    choice, due = reply["choices"][0], completion[: at + 1]
    assert choice["token_ids"] == due and choice["finish_reason"] == "stop"
    assert choice["text"] == demo_codec().decode(completion[:at]) and reply["usage"]["completion_tokens"] == at + 1
    expected = logits[: at + 1].gather(-1, torch.tensor(due)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, atol=1e-4)
    streamed_ids, streamed_logprobs, usage = [], [], None
    asked = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=asked, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for streamed in chunk["choices"]:
                    streamed_ids += streamed["token_ids"]
                    streamed_logprobs += streamed["logprobs"]["token_logprobs"]
    assert streamed_ids == due and streamed_logprobs == choice["logprobs"]["token_logprobs"]
    assert usage["completion_tokens"] == at + 1


def demo_codec():
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.checkpoint.tokenizer import load_codec

    return load_codec(Checkpoint("demo"), None, needed_for="the test")


def demo_tokens(text: str) -> list[int]:
    return demo_codec().encode(text)


def test_token_id_prompts_n_choices_usage_and_max_completion_tokens(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    ids = demo_tokens(PROMPTS[0])
    by_text = client.completions.create(model="demo", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    by_ids = client.completions.create(model="demo", prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="demo", prompt=[ids, ids[:4]], max_tokens=12, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 4 and batch.usage.completion_tokens == 48
    # Seeded choices sample with seed + i, as vLLM's: choice 1 of seed 5 is choice 0 of seed 6.
    sampled = client.completions.create(model="demo", prompt=ids, max_tokens=12, temperature=1.0, seed=5, n=2)
    alone = client.completions.create(model="demo", prompt=ids, max_tokens=12, temperature=1.0, seed=6)
    assert sampled.choices[1].text == alone.choices[0].text != sampled.choices[0].text
    messages = [{"role": "user", "content": "def main():"}]
    stream = client.chat.completions.create(
        model="demo",
        messages=messages,
        max_completion_tokens=7,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert all(chunk.usage is None for chunk in chunks[:-1])


@pytest.mark.parametrize(
    "body, status, param",
    [
        ("{not json", 400, None),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
        ({"prompt": "", "max_tokens": 4}, 400, "prompt"),
        ({"prompt": "x", "n": 17}, 400, "n"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "x", "stop": ""}, 400, "stop"),  # vLLM refuses an empty stop string too
        ({"prompt": "x", "stop": ["END", ""]}, 400, "stop"),
        ({"max_tokens": 4}, 400, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),  # vLLM's bounds: [-2, 2]
        ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),  # > 0
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        ({"prompt": "x", "logit_bias": {"a token": 5}}, 400, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"999999": 5}}, 400, "logit_bias"),  # outside the vocabulary
        (
            {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            400,
            "response_format",
        ),  # a schema xgrammar refuses
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, 400, "response_format"),
        ({"prompt": "x", "structured_outputs": {"regex": "a+", "choice": ["b"]}}, 400, "structured_outputs"),
        ({"prompt": "x", "structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, 400, "structured_outputs"),
        (
            {"prompt": "x", "structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
            400,
            "response_format",
        ),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_survives(server, body, status, param):
    if isinstance(body, str):
        response = httpx.post(
            f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    else:
        response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"] == param
    assert httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}).status_code == 400
    assert httpx.get(f"{server.url}/health").status_code == 200


STRUCTURED = {
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "point",
                "schema": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}},
                    "required": ["x"],
                    "additionalProperties": False,
                },
            },
        }
    },
    "regex": {"structured_outputs": {"regex": "(yes|no)[0-9]{2}"}},
    "choice": {"structured_outputs": {"choice": ["red", "green", "blue"]}},
}


def structured_reply_holds(kind: str, text: str) -> bool:
    if kind == "json_schema":
        return list(json.loads(text)) == ["x"] and isinstance(json.loads(text)["x"], int)
    return re.fullmatch("(yes|no)[0-9]{2}", text) is not None if kind == "regex" else text in ("red", "green", "blue")


@pytest.mark.parametrize("kind", list(STRUCTURED))
def test_structured_output_holds_batched_as_alone(server, kind):
    """Eight prompts at once through continuous batching (rows joining and leaving a running batch, the grammar's
    matchers with them), at k 3: every reply that stopped matches its constraint, and each is the reply the same
    request gets alone. Greedy, with max_tokens room for the JSON to close."""
    bodies = [
        {"prompt": f"Item {i}: " + PROMPTS[i % 3], "max_tokens": 40, "temperature": 0} | STRUCTURED[kind]
        for i in range(8)
    ]
    alone = [complete(server.url, body) for body in bodies]
    with ThreadPoolExecutor(8) as pool:
        batched = list(pool.map(lambda body: complete(server.url, body), bodies))
    assert batched == alone
    stopped = [text for text, reason in alone if reason == "stop"]
    assert len(stopped) >= 4 and all(structured_reply_holds(kind, text) for text in stopped), alone


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("completions", "min_p", 0.1),
        ("completions", "bad_words", ["def"]),
        ("completions", "echo", True),
        ("completions", "guided_json", {"type": "object"}),  # vLLM 0.32 reads structured_outputs, not this
        ("chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ],
)
def test_a_field_that_would_change_the_output_and_is_not_implemented_is_refused(server, path, field, value):
    """Answered without it, the request would get output that silently ignores it: a 400 naming the field. Sent
    with the value that changes nothing, or a field no engine reads, the same request is served."""
    request = {"prompt": "def main():"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    request |= {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    refused = httpx.post(f"{server.url}/v1/{path}", json={**request, field: value}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    message = refused.json()["error"]["message"]
    assert message.startswith(f"{field} is not implemented") and message.endswith(f"sent {value!r}")
    neutral = UNIMPLEMENTED_FIELDS[field][0] if UNIMPLEMENTED_FIELDS[field] else None
    served = httpx.post(f"{server.url}/v1/{path}", json={**request, field: neutral, "user": "u1"}, timeout=60)
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4


def test_api_key_and_a_killed_rank():
    server = Server("--pp", "2", "--api-key", "secret", "--timeout", "10", "--max-num-seqs", "1", "--max-waiting", "1")
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer secret"}
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
        # A client that leaves mid-stream frees its place in the running batch.
        body = {"prompt": "def f(x):\n", "max_tokens": 1900, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)
            assert gauge(server.url, "num_requests_running") == 1
        wait_for_gauge(server.url, "num_requests_running", 0, "the client that left to free its place")
        outcome = {}

        def long_request():
            body = {"prompt": "def f(x):\n", "max_tokens": 1900, "temperature": 0}
            outcome["response"] = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=90)

        thread = threading.Thread(target=long_request)
        thread.start()
        wait_for_gauge(server.url, "num_requests_running", 1, "the long request to take the one running place")
        # One place running (the long request), one waiting: a third request is refused, not queued.
        waiter = threading.Thread(
            target=httpx.post,
            args=(f"{server.url}/v1/completions",),
            kwargs={"json": {"prompt": "x"}, "headers": headers, "timeout": 90},
        )
        waiter.start()
        wait_for_gauge(server.url, "num_requests_waiting", 1, "the second request to take the one waiting place")
        full = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert full.status_code == 429
        assert "the server is full: 1 requests running and 1 waiting" in full.json()["error"]["message"]
        os.kill(server.rank_pids[1], signal.SIGKILL)
        thread.join(timeout=60)
        waiter.join(timeout=60)
        assert not thread.is_alive() and not waiter.is_alive()
        assert outcome["response"].status_code >= 500
        assert "rank 1" in outcome["response"].json()["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 503
        assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers).status_code == 503
    finally:
        server.stop()


def test_refuses_to_start_on_an_error_it_cannot_repair(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(DEMO_DIR, path)
    rename_key(path, "model.layers.4.eh_proj.weight", None)
    result = subprocess.run(
        [sys.executable, "-m", "specdoctor", "serve", "--model", str(path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "refusing to start" in result.stderr and "Traceback" not in result.stderr
