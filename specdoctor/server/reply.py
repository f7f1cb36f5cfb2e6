"""One request's answer in OpenAI's shapes: a choice per job, whole or streamed as server-sent events,
with the text cut at a stop string, log-probabilities when asked for, usage and spec counters."""

from __future__ import annotations

import asyncio
import bisect
import json
import time
import uuid

from specdoctor.runtime.decode.logprobs import TokenLogprob
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.server.protocol import RequestError, SamplingFields
from specdoctor.server.reasoning import ReasoningTemplate
from specdoctor.server.scheduler import ContinuousScheduler, Job
from specdoctor.server.text import StreamedText, apply_stop

LOWEST_LOGPROB = -9999.0  # vLLM's floor for the log-probabilities it returns


class Reply:
    def __init__(
        self, state, body: SamplingFields, jobs: list[Job], chat: bool, thinking: ReasoningTemplate | None = None
    ):
        self.state, self.body, self.jobs, self.chat = state, body, jobs, chat
        self.thinking = thinking  # the reasoning the prompt left open: each message split into reasoning and content
        # Behind a reasoning parser a chat reply's text keeps its special tokens, as vLLM's `hf` parser asks: a close
        # may be one.
        self.skip_special = not (chat and state.reasoning is not None)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.stops = body.stop_strings()
        self.min_tokens = body.min_tokens
        self.texts = {job.id: StreamedText(state.codec, self.stops, self.min_tokens, self.skip_special) for job in jobs}
        for job in jobs:
            job.should_stop = self.texts[job.id].feed if self.stops else None

    def decode(self, tokens: list[int]) -> str:
        return self.state.codec.decode(tokens, self.skip_special)

    def stopped(self, tokens: list[int]) -> bool:
        return self.cut(tokens)[1]

    def cut(self, tokens: list[int]) -> tuple[str, bool]:
        """The text of these tokens, cut at a stop string that ends past the first min_tokens tokens' text."""
        if len(tokens) <= self.min_tokens:
            return self.decode(tokens), False
        floor = len(self.decode(tokens[: self.min_tokens])) if self.min_tokens else 0
        return apply_stop(self.decode(tokens), self.stops, floor)

    def finish(self, job: Job) -> tuple[str, str]:
        """The choice's text and finish reason. A stop string ends the tokens at the one that completed it,
        as an engine checking after every token would (a step may have emitted a few more)."""
        streamed = self.texts.get(job.id)
        if streamed is not None and streamed.stopped:  # cut where the text as it grew met the stop, as streamed
            text, kept = streamed.ready(), streamed.kept_tokens()
        elif streamed is not None and streamed.restarted:  # a whole decode no longer extends the streamed text
            text, kept = streamed.text, None
        else:  # the whole text: a stop may end in the last step's bytes that made no character until now
            text, stopped = self.cut(job.tokens)
            kept = self.kept_tokens(job.tokens) if stopped else None
        if kept is not None:
            job.tokens, job.logprobs = job.tokens[:kept], job.logprobs[:kept]
            job.finish_reason, job.stop_token = "stop", None  # a stop id after the stop string was not reached
        generated = len(job.output_ids())
        self.state.metrics.record_request(job.finish_reason, len(job.sequence.prompt), generated, job.metrics)
        return text, job.finish_reason

    def kept_tokens(self, tokens: list[int]) -> int:
        """How many tokens a stop string keeps: up to the one that completed it."""
        return 1 + bisect.bisect_left(range(1, len(tokens) + 1), True, key=lambda n: self.stopped(tokens[:n]))

    def usage(self) -> dict:
        """Each prompt counted once (n choices share it), every choice's tokens counted."""
        prompt_tokens = sum(len(job.sequence.prompt) for job in self.jobs[:: self.body.n])
        completion_tokens = sum(len(job.output_ids()) for job in self.jobs)
        total = prompt_tokens + completion_tokens
        cached = sum(job.cached_tokens for job in self.jobs[:: self.body.n])  # vLLM's prompt_tokens_details
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def added(self, before: str, after: str) -> tuple[str | None, str | None]:
        """(content, reasoning) that the reply's text `after` adds to `before`, a prefix of it (the whole message
        from ""); reasoning None without a reasoning parser, content None while the reasoning has not ended."""
        if self.thinking is None:
            return after[len(before) :], None
        (was_reasoning, was_content), (reasoning, content) = self.thinking.split(before), self.thinking.split(after)
        return None if content is None else content[len(was_content or "") :], reasoning[len(was_reasoning) :]

    def choice(
        self, index: int, text: str, reason: str | None, delta: bool, tokens: tuple[int, int], before: str = ""
    ) -> dict:
        """Choice `index` covering its output tokens [start, end) (a stream's delta covers those it adds), with
        what the text adds to `before` (a stream's text sent until then)."""
        job = self.jobs[index]
        logprobs = token_logprobs(job, *tokens)
        shown = self.logprobs(logprobs, delta) if job.sequence.logprobs is not None else None
        content, reasoning = self.added(before, text)
        if not self.chat:
            found = {"index": index, "text": content, "logprobs": shown, "finish_reason": reason}
        else:
            message = {"role": "assistant", "content": content}
            if self.thinking is not None and (reasoning or not delta):  # a delta carries it while it grows
                message["reasoning"] = reasoning or None
            if self.thinking is not None and not delta:  # vLLM's message: null where nothing follows the close
                message["content"] = content or None
            key = "delta" if delta else "message"
            found = {"index": index, key: message, "logprobs": shown, "finish_reason": reason}
        if self.body.return_token_ids:  # as vLLM returns them: the prompt's once, then the output's
            found["prompt_token_ids"] = list(job.sequence.prompt) if tokens[0] == 0 else None
            found["token_ids"] = job.output_ids()[tokens[0] : tokens[1]]
        return found

    def logprobs(self, entries: list[tuple[int, TokenLogprob]], delta: bool) -> dict:
        """OpenAI's shapes: chat's `content` list, or the completions API's parallel lists."""
        if self.chat:
            return {"content": [self.chat_entry(token, lp, top) for token, (lp, top) in entries]}
        texts = [self.entry_text(token) for token, _ in entries]
        offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
        return {
            "tokens": [self.token_label(token) for token, _ in entries],
            "token_logprobs": [shown(lp) for _, (lp, _) in entries],
            "top_logprobs": [{self.token_label(t): shown(v) for t, v in top} for _, (_, top) in entries],
            "text_offset": offsets,
        }

    def token_label(self, token: int) -> str:
        """A token as log-probability entries name it: its text, or "token_id:N" when the request asked (vLLM's
        spelling; texts collide where tokens decode alike)."""
        return f"token_id:{token}" if self.body.return_tokens_as_token_ids else self.entry_text(token)

    def entry_text(self, token: int) -> str:
        """One token's text in a log-probability entry: decoded alone with special tokens named, as vLLM decodes
        each entry (an end-of-sequence id is '<|endoftext|>' there, where the reply's text leaves it out)."""
        return self.state.codec.decode([token], skip_special_tokens=False)

    def chat_entry(self, token: int, logprob: float, top: list[tuple[int, float]]) -> dict:
        def described(token: int, value: float) -> dict:
            text = self.entry_text(token)
            return {"token": self.token_label(token), "logprob": shown(value), "bytes": list(text.encode())}

        return {**described(token, logprob), "top_logprobs": [described(t, v) for t, v in top]}

    def envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }

    async def whole(self, scheduler: ContinuousScheduler) -> dict:
        try:
            await asyncio.gather(*(scheduler.result(job) for job in self.jobs))
        except Exception as err:
            self.record_failure()
            raise RequestError(f"generation failed: {err}", status=500, kind="server_error") from None
        choices = []
        for index, job in enumerate(self.jobs):
            text, reason = self.finish(job)
            choices.append(self.choice(index, text, reason, False, (0, len(job.output_ids()))))
            if job.sequence.prompt_logprobs is not None and not self.chat:  # vLLM's: on each completion choice
                choices[-1]["prompt_logprobs"] = self.prompt_logprobs(job)
        spec = combined([job.metrics for job in self.jobs])
        whole = {**self.envelope(choices, chunk=False), "usage": self.usage(), **self.spec_fields(spec)}
        if self.chat and self.jobs[0].sequence.prompt_logprobs is not None:  # and on a chat reply, once
            whole["prompt_logprobs"] = self.prompt_logprobs(self.jobs[0])
        return whole

    def prompt_logprobs(self, job: Job) -> list[dict | None]:
        """vLLM's shape: None for the first prompt token, then per token its entry (log-probability, rank in the
        vocabulary, text) and its top alternatives', keyed by token id."""

        def entry(value: float, rank: int, token: int) -> dict:
            return {"logprob": shown(value), "rank": rank, "decoded_token": self.token_label(token)}

        shaped: list[dict | None] = [None]
        for token, (value, rank, top) in zip(job.sequence.prompt[1:], job.prompt_logprobs or [], strict=True):
            found = {str(token): entry(value, rank, token)}
            for place, (alternative, logprob) in enumerate(top, start=1):
                found.setdefault(str(alternative), entry(logprob, place, alternative))
            shaped.append(found)
        return shaped

    def record_failure(self) -> None:
        for job in self.jobs:
            self.state.metrics.record_request("error", len(job.sequence.prompt), 0, None)

    async def events(self, scheduler: ContinuousScheduler):
        updates: asyncio.Queue[int | None] = asyncio.Queue()  # a job's index when it gained tokens; None: all ended
        for index, job in enumerate(self.jobs):
            job.on_tokens = lambda index=index: updates.put_nowait(index)
        generation = asyncio.gather(*(scheduler.result(job) for job in self.jobs))
        generation.add_done_callback(lambda _: updates.put_nowait(None))
        sent, sent_tokens = [""] * len(self.jobs), [0] * len(self.jobs)
        try:
            while (index := await updates.get()) is not None:
                job = self.jobs[index]
                text = self.texts[job.id]
                text.feed(job.tokens)
                ready = self.thinking.settled(text.ready()) if self.thinking else text.ready()
                if len(ready) > len(sent[index]):
                    covered = text.kept_tokens() if text.stopped else len(job.tokens)  # none past a stop
                    yield self.chunk(index, ready, sent[index], None, job, sent_tokens[index], covered)
                    sent[index], sent_tokens[index] = ready, covered
            await generation
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: its requests leave the batch
            generation.cancel()
            raise
        except Exception as err:
            self.record_failure()
            yield self.sse(RequestError(f"generation failed: {err}", status=500, kind="server_error").body())
            return
        for index, job in enumerate(self.jobs):
            text, reason = self.finish(job)
            whole = text if text.startswith(sent[index]) else sent[index]  # nothing more where it parts from the sent
            covered = (sent_tokens[index], len(job.output_ids()))
            yield self.chunk(index, whole, sent[index], reason, job, *covered, self.spec_fields(job.metrics))
        if self.body.include_usage:  # OpenAI's last chunk: no choices, the whole request's usage
            yield self.sse({**self.envelope([], chunk=True), "usage": self.usage()})
        yield "data: [DONE]\n\n"

    def chunk(
        self, index: int, text: str, before: str, reason, job: Job, start: int, end: int, extra: dict | None = None
    ) -> str:
        """A streamed delta: what the text adds to `before`, with the log-probabilities of the tokens it newly
        covers."""
        choice = self.choice(index, text, reason, True, (start, end), before)
        return self.sse({**self.envelope([choice], True), **(extra or {})})

    def spec_fields(self, spec: SpecMetrics) -> dict:
        """The speculative counters, when speculative decoding is on."""
        return {"spec_decode": spec.to_dict()} if self.state.metrics.speculative else {}

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"


def shown(logprob: float) -> float:
    """A log-probability as the API reports it: a token structured output rules out has -inf, which JSON cannot
    carry; vLLM reports it as -9999.0."""
    return max(logprob, LOWEST_LOGPROB)


def token_logprobs(job: Job, start: int, end: int) -> list[tuple[int, TokenLogprob]]:
    """(token, its log-probability entry) for output tokens [start, end) (a stop token id's included, as vLLM
    reports it), when the request asked for them."""
    if job.sequence.logprobs is None:
        return []
    return list(zip(job.output_ids()[start:end], job.logprobs[start:end], strict=True))


def combined(metrics: list[SpecMetrics]) -> SpecMetrics:
    total = SpecMetrics()
    for one in metrics:
        total.add(one)
    return total
