"""One request's answer (server/reply.py): text cut at the earliest stop string and the tokens ending at
the one that completed it, finish reasons, usage with a prompt counted once for its n choices, the OpenAI
shapes of choices, log-probabilities (the completions API's parallel lists, chat's content entries) and
envelopes, whole and streamed, through the real scheduler.

The demo's own tokenizer decodes; the engine is the one stand-in (tests/server/test_scheduler.py's
BatchEngine: a real Engine needs rank processes). Oracles: the OpenAI API's definitions (text_offset is
each token's character offset in the text; a chat entry's bytes are its text's UTF-8 bytes), and a
linear scan for the token that completes a stop string."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import load_codec
from specdoctor.runtime.decode.adjustments import LogitAdjustments
from specdoctor.runtime.decode.continuous import RowUpdate
from specdoctor.runtime.decode.logprobs import emitted_logprobs
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.decode.requests import SequenceRequest
from specdoctor.server.app import ServerState
from specdoctor.server.metrics import ServerMetrics
from specdoctor.server.protocol import ChatRequest, CompletionRequest
from specdoctor.server.reasoning import ReasoningTemplate
from specdoctor.server.reply import Reply, token_logprobs
from specdoctor.server.scheduler import ContinuousScheduler, Job
from specdoctor.server.text import StreamedText, apply_stop
from tests.server.test_scheduler import BatchEngine

CODEC = load_codec(Checkpoint("demo"), None, needed_for="the test")
PROMPT = CODEC.encode("import os\n")
TEXT = "def read_config(path):\n    return 1\n"
TOKENS = CODEC.encode(TEXT)  # 'def', ' read', '_', 'config', '(', 'path', '):', '\n   ', ' return', ' 1', '\n'


def server_state() -> ServerState:
    return ServerState(None, CODEC, "demo", "", None, ServerMetrics("demo", speculative=True))


def entries_for(tokens: list[int], top: int, seed: int = 0):
    """Log-probability entries as the last rank computes them, from random target logits."""
    logits = torch.randn(1, len(tokens), 2048, generator=torch.Generator().manual_seed(seed))
    return emitted_logprobs(logits, torch.tensor([tokens]), {0: top})[0]


def finished_job(tokens: list[int], reason: str, logprobs: int | None = None, prompt=PROMPT) -> Job:
    job = Job(SequenceRequest(list(prompt), 64, logprobs=logprobs), tokens=list(tokens), finish_reason=reason)
    job.logprobs = entries_for(tokens, logprobs) if logprobs is not None else []
    job.metrics.record(2, 3)
    return job


def completing_token(tokens: list[int], stops: list[str]) -> int:
    """How many tokens an engine checking after every token keeps: up to the first that completes a stop."""
    return next(n for n in range(1, len(tokens) + 1) if any(s in CODEC.decode(tokens[:n]) for s in stops))


@pytest.mark.parametrize(
    "text, stops, expected",
    [
        ("abc STOP def END", ["END", "STOP"], ("abc ", True)),  # the earliest in the text, not in the list
        ("say </answer> now", ["</answer>", "answer"], ("say </", True)),  # the first to complete, as vLLM cuts
        ("abc STOP def", ["nope"], ("abc STOP def", False)),
        ("STOP at once", ["STOP"], ("", True)),
        ("overlap: ENDSTOP", ["STOP", "DST"], ("overlap: EN", True)),
    ],
)
def test_apply_stop_cuts_at_the_stop_string_that_completes_first(text, stops, expected):
    assert apply_stop(text, stops) == expected


@pytest.mark.parametrize(
    "min_tokens, kept",
    [
        (0, "def read_config(path):"),
        (7, "def read_config(path):"),  # the stop begins where the first 7 tokens' text ends: it counts
        (8, "def read_config(path):\n    return 1"),  # the 8th token holds the first newline: the second counts
        (11, None),  # every token within min_tokens: no stop
    ],
)
def test_a_stop_string_counts_only_where_it_ends_past_the_first_min_tokens_tokens(min_tokens, kept):
    """vLLM looks for stop strings only where they end in the text after the first min_tokens tokens: streamed a
    token at a time and whole, the same cut."""
    expected = (TEXT, False) if kept is None else (kept, True)
    streamed = StreamedText(CODEC, ["\n"], min_tokens)
    for end in range(1, len(TOKENS) + 1):
        streamed.feed(TOKENS[:end])
    assert (streamed.ready() if streamed.stopped else streamed.text, streamed.stopped) == expected
    job = Job(SequenceRequest(PROMPT, 16, adjustments=LogitAdjustments(min_tokens=min_tokens)))
    reply = Reply(server_state(), CompletionRequest(prompt="x", stop=["\n"], min_tokens=min_tokens), [job], False)
    assert reply.cut(TOKENS) == expected


@pytest.mark.parametrize(
    "stops",
    [
        ["_con", "return"],  # '_con' is completed inside the token 'config'
        ["return", "(path"],  # '(path' spans two tokens; the earlier of the two stops
        ["):\n"],  # ends in the middle of '\n   '
    ],
)
def test_a_stop_string_ends_the_tokens_at_the_one_that_completed_it(stops):
    state = server_state()
    reply = Reply(state, CompletionRequest(prompt="x", stop=stops, logprobs=1), [], chat=False)
    job = finished_job(TOKENS, "length", logprobs=1)  # the engine ran on past the stop within its step
    entries = list(job.logprobs)
    text, reason = reply.finish(job)
    kept = completing_token(TOKENS, stops)
    assert kept < len(TOKENS)
    assert (text, reason) == (apply_stop(TEXT, stops)[0], "stop")
    assert job.tokens == TOKENS[:kept] and job.logprobs == entries[:kept] and job.finish_reason == "stop"
    sample = state.metrics.registry.get_sample_value
    assert sample("vllm:request_success_total", {"model_name": "demo", "finished_reason": "stop"}) == 1
    assert sample("vllm:generation_tokens_total", {"model_name": "demo"}) == kept
    assert sample("vllm:prompt_tokens_total", {"model_name": "demo"}) == len(PROMPT)


@pytest.mark.parametrize("reason", ["length", "stop"])  # "stop": the engine met a stop token id
def test_without_a_stop_string_the_engines_tokens_and_finish_reason_stand(reason):
    state = server_state()
    reply = Reply(state, CompletionRequest(prompt="x", stop=["never"]), [], chat=False)
    job = finished_job(TOKENS, reason)
    assert reply.finish(job) == (TEXT, reason)
    assert job.tokens == TOKENS
    sample = state.metrics.registry.get_sample_value
    assert sample("vllm:request_success_total", {"model_name": "demo", "finished_reason": reason}) == 1


def test_usage_counts_each_prompt_once_for_its_n_choices_and_every_choices_tokens():
    first, second = CODEC.encode("import os\n"), CODEC.encode("class Parser:\n    def")
    jobs = [
        finished_job(TOKENS[:3], "length", prompt=first),
        finished_job(TOKENS[:5], "length", prompt=first),
        finished_job(TOKENS[:2], "length", prompt=second),
        finished_job(TOKENS[:7], "length", prompt=second),
    ]
    jobs[2].cached_tokens = jobs[3].cached_tokens = 16  # the second prompt's first block, found in the prefix cache
    reply = Reply(server_state(), CompletionRequest(prompt=["import os\n", "class"], n=2), jobs, chat=False)
    prompt, completion = len(first) + len(second), 3 + 5 + 2 + 7
    assert reply.usage() == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 16},  # once per prompt, as the prompt tokens
    }


def test_completion_logprobs_are_the_completions_apis_parallel_lists():
    job = finished_job(TOKENS, "length", logprobs=2)
    reply = Reply(server_state(), CompletionRequest(prompt="x", logprobs=2), [job], chat=False)
    choice = reply.choice(0, TEXT, "length", False, (0, len(TOKENS)))
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, TEXT, "length")
    shown = choice["logprobs"]
    texts = [CODEC.decode([t]) for t in TOKENS]
    assert shown["tokens"] == texts and "".join(texts) == TEXT
    assert shown["token_logprobs"] == [value for value, _ in job.logprobs]
    for offset, token in zip(shown["text_offset"], texts, strict=True):
        assert TEXT[offset : offset + len(token)] == token  # each token's character offset in the text
    assert shown["text_offset"][0] == 0
    for top, (_, alternatives) in zip(shown["top_logprobs"], job.logprobs, strict=True):
        assert top == {CODEC.decode([t]): v for t, v in alternatives} and len(top) <= 2
        values = list(top.values())
        assert all(v <= 0 for v in values) and values == sorted(values, reverse=True)  # log-probabilities, best first
    # A streamed delta covers only the tokens it carries.
    part = reply.choice(0, "", None, True, (3, 5))["logprobs"]
    assert part["tokens"] == texts[3:5] and part["text_offset"] == [0, len(texts[3])]


def test_chat_logprobs_are_content_entries_with_their_utf8_bytes_and_top_alternatives():
    job = finished_job(TOKENS, "length", logprobs=3)
    body = ChatRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3)
    reply = Reply(server_state(), body, [job], chat=True)
    whole = reply.choice(0, TEXT, "length", False, (0, len(TOKENS)))
    assert whole["message"] == {"role": "assistant", "content": TEXT} and whole["finish_reason"] == "length"
    content = whole["logprobs"]["content"]
    assert "".join(entry["token"] for entry in content) == TEXT
    for entry, token, (value, top) in zip(content, TOKENS, job.logprobs, strict=True):
        text = CODEC.decode([token])
        assert entry == {
            "token": text,
            "logprob": value,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": CODEC.decode([t]), "logprob": v, "bytes": list(CODEC.decode([t]).encode("utf-8"))}
                for t, v in top
            ],
        }
        assert len(entry["top_logprobs"]) == 3
    delta = reply.choice(0, "de", None, True, (0, 0))
    assert delta["delta"] == {"role": "assistant", "content": "de"} and "message" not in delta


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_an_end_of_sequence_ids_entry_names_the_token_its_text_left_out(chat):
    """The end-of-sequence id that ended a reply: its log-probability entry named as vLLM decodes each entry (one
    token, special tokens kept: '<|endoftext|>'), while the reply's text leaves it out."""
    eos = CODEC.tokenizer.token_to_id("<|endoftext|>")
    job = finished_job([*TOKENS, eos], "stop", logprobs=1)
    job.tokens, job.stop_token = list(TOKENS), eos
    body = (
        ChatRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=1)
        if chat
        else CompletionRequest(prompt="import os\n", logprobs=1)
    )
    choice = Reply(server_state(), body, [job], chat=chat).choice(0, TEXT, "stop", False, (0, len(TOKENS) + 1))
    named = [e["token"] for e in choice["logprobs"]["content"]] if chat else choice["logprobs"]["tokens"]
    assert named[-1] == "<|endoftext|>" and "".join(named[:-1]) == TEXT
    assert (choice["message"]["content"] if chat else choice["text"]) == TEXT


def test_no_logprobs_unless_asked_for():
    job = finished_job(TOKENS, "length")
    reply = Reply(server_state(), CompletionRequest(prompt="x"), [job], chat=False)
    assert token_logprobs(job, 0, len(TOKENS)) == []
    assert reply.choice(0, TEXT, "length", False, (0, len(TOKENS)))["logprobs"] is None


def test_return_token_ids_gives_the_prompts_ids_once_and_each_deltas_own():
    """vLLM's extension, as vLLM returns it: the prompt's ids on the choice that starts the output, and each
    choice or delta's own output ids; nothing unless asked."""
    job = finished_job(TOKENS, "length")
    reply = Reply(server_state(), CompletionRequest(prompt="x", return_token_ids=True), [job], chat=False)
    whole = reply.choice(0, TEXT, "length", False, (0, len(TOKENS)))
    assert whole["token_ids"] == TOKENS and whole["prompt_token_ids"] == list(job.sequence.prompt)
    later = reply.choice(0, "", None, True, (3, 5))
    assert later["token_ids"] == TOKENS[3:5] and later["prompt_token_ids"] is None
    plain = Reply(server_state(), CompletionRequest(prompt="x"), [job], chat=False)
    assert "token_ids" not in plain.choice(0, TEXT, "length", False, (0, len(TOKENS)))


def serve(reply: Reply, jobs: list[Job], consume):
    """Enqueue the jobs on a real scheduler serving BatchEngine, and return what `consume(reply, scheduler,
    step)` gives; `step(updates)` hands the engine one step's news, {job index: RowUpdate}."""
    engine = BatchEngine()
    scheduler = ContinuousScheduler(engine, reply.state.metrics)

    def step(updates: dict[int, RowUpdate]) -> None:
        engine.news.put({jobs[row].id: update for row, update in updates.items()})

    async def main():
        serving = asyncio.create_task(scheduler.run())
        try:
            scheduler.enqueue(jobs)
            return await asyncio.wait_for(consume(reply, scheduler, step), timeout=10)
        finally:
            serving.cancel()

    return asyncio.run(main())


def step_update(tokens: list[int], reason: str | None = None, seed: int = 1) -> RowUpdate:
    metrics = SpecMetrics()
    metrics.record(1, 3)
    return RowUpdate(tokens, reason, metrics, entries_for(tokens, 1, seed) if tokens else [])


def in_lockstep(steps: list[RowUpdate]):
    """A consumer of the stream that hands the engine the next step only once the stream has sent an event
    for the previous one (each step below makes one), so what each event covers does not depend on timing."""

    async def consume(reply, scheduler, step):
        events, seen = reply.events(scheduler), []
        for update in steps:
            step({0: update})
            seen.append(await anext(events))
        return seen + [event async for event in events]

    return consume


def events_payloads(events: list[str]) -> list[dict]:
    assert events[-1] == "data: [DONE]\n\n"
    assert all(event.startswith("data: ") and event.endswith("\n\n") for event in events)
    return [json.loads(event[len("data: ") :]) for event in events[:-1]]


def test_a_whole_completion_through_the_scheduler_ends_at_the_stop_string():
    """One step emits the whole text, past the stop string: the scheduler ends the request, the reply
    trims it, and the usage counts the kept tokens."""
    jobs = [Job(SequenceRequest(PROMPT, 64, logprobs=0))]
    reply = Reply(server_state(), CompletionRequest(prompt="import os\n", stop="(path", logprobs=0), jobs, chat=False)

    async def whole(reply, scheduler, step):
        step({0: step_update(TOKENS)})
        return await reply.whole(scheduler)

    answer = serve(reply, jobs, whole)
    kept = completing_token(TOKENS, ["(path"])
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-") and answer["model"] == "demo"
    [choice] = answer["choices"]
    assert choice["text"] == "def read_config" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == [CODEC.decode([t]) for t in TOKENS[:kept]]
    assert answer["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": kept,
        "total_tokens": len(PROMPT) + kept,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert answer["spec_decode"]["num_drafts"] == 1 and answer["spec_decode"]["num_draft_tokens"] == 3


def test_a_stream_never_sends_text_that_becomes_a_stop_string_and_ends_with_usage():
    """Step by step, 'def read' '_' 'config' '(' with the stop '_config(': the stream holds back what may
    still become the stop (its length - 1 characters), so its deltas join to exactly the text before it."""
    jobs = [Job(SequenceRequest(PROMPT, 64))]
    body = ChatRequest(
        messages=[{"role": "user", "content": "hi"}],
        stop="_config(",
        stream=True,
        stream_options={"include_usage": True},
    )
    reply = Reply(server_state(), body, jobs, chat=True)
    steps = [step_update(TOKENS[:2]), step_update(TOKENS[2:3]), step_update(TOKENS[3:4]), step_update(TOKENS[4:5])]
    payloads = events_payloads(serve(reply, jobs, in_lockstep(steps)))
    chunks, usage = payloads[:-1], payloads[-1]
    assert all(p["object"] == "chat.completion.chunk" and p["id"] == reply.id for p in payloads)
    deltas = [chunk["choices"][0]["delta"]["content"] for chunk in chunks]
    assert deltas == ["d", "e", "f read", ""]  # 'def read' less 7 held back, then one more each step
    assert "".join(deltas) == apply_stop(TEXT, ["_config("])[0] == "def read"
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, None, None, "stop"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == completing_token(TOKENS, ["_config("])


def test_a_reasoning_streams_apart_from_the_content_and_never_sends_the_start_of_its_close():
    """A reasoning the prompt left open, closed by '_config(': the first step's text ends in '_', which may begin
    the close, so the stream sends 'def read' as reasoning and holds the '_' back; the close is never sent; the
    content follows as content deltas, and the whole message is the same split."""
    thinking = ReasoningTemplate(("assistant:",), ("<think>",), ("_config(",), ((0,),))
    jobs = [Job(SequenceRequest(PROMPT, 64))]
    body = ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    reply = Reply(server_state(), body, jobs, chat=True, thinking=thinking)
    steps = [
        step_update(TOKENS[:3]),
        step_update(TOKENS[3:5]),
        step_update(TOKENS[5:9]),
        step_update(TOKENS[9:], "length"),
    ]
    deltas = [p["choices"][0]["delta"] for p in events_payloads(serve(reply, jobs, in_lockstep(steps)))]
    assert [delta.get("reasoning") for delta in deltas] == ["def read", None, None, None, None]  # the last: its end
    assert [delta["content"] for delta in deltas] == [None, "", "path):\n    return", " 1\n", ""]
    whole = Reply(server_state(), body.model_copy(update={"stream": False}), jobs, chat=True, thinking=thinking)
    message = whole.choice(0, TEXT, "length", False, (0, len(TOKENS)))["message"]
    assert (message["reasoning"], message["content"]) == ("def read", "path):\n    return 1\n")


def test_behind_a_reasoning_parser_a_chat_replys_text_keeps_special_tokens_so_a_special_close_is_found():
    """vLLM's `hf` parser turns skip_special_tokens off for chat requests: a close that is a special token (here the
    demo's only one) splits the reply, and nothing follows it: content null, as vLLM's message has it."""
    eos = CODEC.tokenizer.token_to_id("<|endoftext|>")
    thinking = ReasoningTemplate(("assistant:",), ("<think>",), ("<|endoftext|>",), ((eos,),))
    state = server_state()
    state.reasoning = thinking
    job = finished_job([*TOKENS, eos], "length")
    body = ChatRequest(messages=[{"role": "user", "content": "hi"}])
    text, _ = Reply(state, body, [job], chat=True, thinking=thinking).finish(job)
    message = Reply(state, body, [job], chat=True, thinking=thinking).choice(0, text, "length", False, (0, 12))
    assert text == TEXT + "<|endoftext|>" and message["message"]["reasoning"] == TEXT
    assert message["message"]["content"] is None
    assert Reply(server_state(), body, [job], chat=True).finish(job)[0] == TEXT  # no parser: special tokens skipped


def test_streamed_logprobs_cover_exactly_the_tokens_of_the_whole_reply():
    """Three steps of a few tokens each, no stop string: each delta carries the entries of the tokens it
    newly covers, so across the stream they are the whole reply's, in order."""
    jobs = [Job(SequenceRequest(PROMPT, 64, logprobs=1))]
    reply = Reply(server_state(), CompletionRequest(prompt="import os\n", logprobs=1, stream=True), jobs, chat=False)
    steps = [step_update(TOKENS[:4], seed=1), step_update(TOKENS[4:9], seed=2), step_update(TOKENS[9:], "length", 3)]
    payloads = events_payloads(serve(reply, jobs, in_lockstep(steps)))
    assert all(p["object"] == "text_completion" for p in payloads)
    choices = [p["choices"][0] for p in payloads]
    assert [c["text"] for c in choices] == [
        CODEC.decode(TOKENS[:4]),
        CODEC.decode(TOKENS[4:9]),
        CODEC.decode(TOKENS[9:]),
        "",
    ]
    assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]
    covered = [c["logprobs"]["tokens"] for c in choices]
    assert covered == [[CODEC.decode([t]) for t in part] for part in (TOKENS[:4], TOKENS[4:9], TOKENS[9:], [])]
    values = [v for c in choices for v in c["logprobs"]["token_logprobs"]]
    assert values == [value for value, _ in jobs[0].logprobs] and len(values) == len(TOKENS)
    assert payloads[-1]["spec_decode"]["num_drafts"] == 1  # the last step's counters


def test_a_step_past_a_stop_string_streams_only_the_kept_tokens_logprobs():
    """A speculative step emits several tokens, the stop string completed among them and more after it:
    the stream must carry the same entries as the whole reply, those of the kept tokens."""
    jobs = [Job(SequenceRequest(PROMPT, 64, logprobs=0))]
    reply = Reply(
        server_state(), CompletionRequest(prompt="x", stop="(path", logprobs=0, stream=True), jobs, chat=False
    )
    steps = [step_update(TOKENS[:2], seed=1), step_update(TOKENS[2:9], seed=2)]
    payloads = events_payloads(serve(reply, jobs, in_lockstep(steps)))
    choices = [p["choices"][0] for p in payloads]
    assert "".join(c["text"] for c in choices) == "def read_config" and choices[-1]["finish_reason"] == "stop"
    kept = completing_token(TOKENS, ["(path"])
    assert jobs[0].tokens == TOKENS[:kept]
    streamed_tokens = [t for c in choices for t in c["logprobs"]["tokens"]]
    assert streamed_tokens == [CODEC.decode([t]) for t in TOKENS[:kept]]


def test_a_stream_closed_at_a_chunk_takes_its_request_out_of_the_engine():
    """A client that goes away while its stream waits at a chunk: the server closes the stream there (GeneratorExit,
    not a cancelled task), and the request must leave the batch then, not run on to its limit."""
    jobs = [Job(SequenceRequest(PROMPT, 64))]
    reply = Reply(server_state(), CompletionRequest(prompt="x", stream=True), jobs, chat=False)

    async def close_after_one_chunk(reply, scheduler, step):
        events = reply.events(scheduler)
        step({0: step_update(TOKENS[:2])})
        await anext(events)
        running_before = list(scheduler.engine.batch)
        await events.aclose()
        for _ in range(3):  # the cancellation reaches the job's waiter in a later turn of the loop
            await asyncio.sleep(0)
        return running_before, dict(scheduler.running), list(scheduler.engine.batch)

    running_before, running, batch = serve(reply, jobs, close_after_one_chunk)
    assert running_before == [jobs[0].id]
    assert running == {} and batch == []
