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
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specdoctor.runtime.checkpoint import DEMO_DIR
from specdoctor.server.protocol import PLAIN_CHAT_TEMPLATE, ChatMessage, render_chat
from tests.helpers.servers import SpecdoctorServer as Server
from tests.helpers.servers import free_port
from tests.test_cli import rename_key

PROMPTS = ["def read_config(path):\n", "class Parser:\n    def __init__(self", "import os\nimport sys\n"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


@pytest.fixture(scope="module")
def server():
    server = Server("--pp", "2", "--num-speculative-tokens", "3")
    yield server
    server.stop()
    assert server.process.returncode is not None
    time.sleep(2)
    assert not any(alive(pid) for pid in server.rank_pids)  # SIGTERM stopped every rank


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


def test_stop_strings_cut_the_text(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    full = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    stop = full[5:8]
    cut = httpx.post(f"{server.url}/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"


def scrape(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if match := re.match(r"^(\S+?)(\{.*\})? (\S+)$", line):
            samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return samples


def stream_completion(url: str, prompt: str) -> tuple[str, dict]:
    text, spec = "", None
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["text"]
                spec = chunk.get("spec_decode", spec)
    return text, spec


def test_32_concurrent_streaming_clients_match_sequential_and_metrics_add_up(server):
    prompts = [f"def function_{i}(value):\n    return" for i in range(32)]
    sequential = [
        httpx.post(
            f"{server.url}/v1/completions", json={"prompt": p, "max_tokens": 20, "temperature": 0}, timeout=60
        ).json()["choices"][0]["text"]
        for p in prompts
    ]
    before = scrape(server.url)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: stream_completion(server.url, p), prompts))
    after = scrape(server.url)
    assert [text for text, _ in results] == sequential
    label = '{model_name="demo"}'
    for counter, field in [
        ("vllm:spec_decode_num_drafts_total", "num_drafts"),
        ("vllm:spec_decode_num_draft_tokens_total", "num_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens_total", "num_accepted_tokens"),
    ]:
        assert after[counter + label] - before[counter + label] == sum(spec[field] for _, spec in results)
    position0 = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="demo",position="0"}'
    assert after[position0] - before[position0] == sum(s["num_accepted_tokens_per_pos"][0] for _, s in results)
    ttft = 'vllm:time_to_first_token_seconds_count{model_name="demo"}'
    assert after[ttft] - before[ttft] == 32


@pytest.mark.parametrize(
    "body, status, param",
    [
        ("{not json", 400, None),
        ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
        ({"prompt": "", "max_tokens": 4}, 400, "prompt"),
        ({"prompt": "x", "n": 2}, 400, "n"),
        ({"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"max_tokens": 4}, 400, "prompt"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
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


def test_api_key_and_a_killed_rank():
    server = Server("--pp", "2", "--api-key", "secret", "--timeout", "10")
    try:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer secret"}
        assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 200
        outcome = {}

        def long_request():
            body = {"prompt": "def f(x):\n", "max_tokens": 1900, "temperature": 0}
            outcome["response"] = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=90)

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(2)
        os.kill(server.rank_pids[1], signal.SIGKILL)
        thread.join(timeout=60)
        assert not thread.is_alive()
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
