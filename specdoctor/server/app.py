"""The HTTP API: OpenAI's completions, chat completions and models, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specdoctor.runtime.engine import Engine
from specdoctor.runtime.metrics import SpecMetrics
from specdoctor.runtime.sampling import SamplingParams
from specdoctor.runtime.tokenizer import TextCodec
from specdoctor.server.metrics import ServerMetrics
from specdoctor.server.protocol import ChatRequest, CompletionRequest, RequestError, SamplingFields, render_chat
from specdoctor.server.scheduler import BatchScheduler, Job

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass
class ServerState:
    engine: Engine
    codec: TextCodec
    model_name: str
    chat_template: str
    api_key: str | None
    metrics: ServerMetrics


def apply_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut the text at the earliest stop string; True when one was found."""
    cuts = [index for stop in stops if (index := text.find(stop)) >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def create_app(state: ServerState) -> FastAPI:
    scheduler = BatchScheduler(state.engine, state.metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(scheduler.run())
        yield
        task.cancel()
        # Close the ranks here: on SIGTERM uvicorn re-raises the signal once this returns.
        await asyncio.to_thread(state.engine.close)

    app = FastAPI(title="specdoctor", lifespan=lifespan)

    add_error_handlers(app)

    @app.middleware("http")
    async def authorise(request: Request, call_next):
        if state.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {state.api_key}":
                error = RequestError("invalid or missing API key", status=401, kind="authentication_error")
                return JSONResponse(error.body(), 401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        alive = state.engine.alive
        body = {"status": "ok" if alive else "unhealthy", "rank_pids": state.engine.rank_pids}
        return JSONResponse(body, 200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "specdoctor"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await respond(body, body.text(), chat=False, default_max_tokens=DEFAULT_MAX_TOKENS)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        return await respond(body, render_chat(state.chat_template, body.messages), chat=True, default_max_tokens=None)

    async def respond(body: SamplingFields, prompt: str, chat: bool, default_max_tokens: int | None):
        job = make_job(state, body, prompt, default_max_tokens)
        reply = Reply(state, body, job, chat)
        if body.stream:
            return StreamingResponse(reply.events(scheduler), media_type="text/event-stream")
        return await reply.whole(scheduler)

    return app


def make_job(state: ServerState, body: SamplingFields, prompt: str, default_max_tokens: int | None) -> Job:
    """Validate a request into a job; None as the default means: up to the context."""
    if body.model not in (None, state.model_name):
        raise RequestError(
            f"model {body.model!r} is not served here (serving {state.model_name!r})",
            "model",
            404,
            "not_found_error",
        )
    if body.n != 1:
        raise RequestError("only n = 1 is supported", "n")
    if not state.engine.alive:
        raise RequestError("the pipeline is down: a rank has died", status=503, kind="server_error")
    ids = state.codec.encode(prompt) if prompt else []
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    context = state.engine.config.max_position_embeddings
    max_tokens = body.max_tokens or min(default_max_tokens or context, context - len(ids))
    if len(ids) + max_tokens > context:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of {context} tokens",
            "max_tokens",
        )
    sampling = SamplingParams(float(body.temperature), 0, float(body.top_p), body.seed)
    return Job(ids, max_tokens, sampling)


def add_error_handlers(app: FastAPI) -> None:
    """Bad requests become OpenAI-style error bodies."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        location = first.get("loc", ())
        where = str(location[1]) if len(location) > 1 else None  # the field, without union-member suffixes
        return JSONResponse(
            RequestError(f"{where or 'body'}: {first.get('msg', 'invalid request')}", where).body(), 400
        )

    @app.exception_handler(RequestError)
    async def refused(_request, error: RequestError):
        return JSONResponse(error.body(), error.status)


class Reply:
    """One request's answer: whole, or streamed as server-sent events."""

    def __init__(self, state: ServerState, body: SamplingFields, job: Job, chat: bool):
        self.state, self.body, self.job, self.chat = state, body, job, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        self.stops = body.stop_strings()

    def finish(self, tokens: list[int], reason: str, spec: SpecMetrics) -> tuple[str, str, dict]:
        text, stopped = apply_stop(self.state.codec.decode(tokens), self.stops)
        usage = {
            "prompt_tokens": len(self.job.prompt_ids),
            "completion_tokens": len(tokens),
            "total_tokens": len(self.job.prompt_ids) + len(tokens),
        }
        reason = "stop" if stopped else reason
        self.state.metrics.record_request(reason, len(self.job.prompt_ids), len(tokens), spec)
        return text, reason, usage

    def choice(self, text: str, reason: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        key = "delta" if delta else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": reason}

    def envelope(self, choice: dict, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.state.model_name,
            "choices": [choice],
        }

    async def whole(self, scheduler: BatchScheduler):
        try:
            tokens, reason, spec = await scheduler.submit(self.job)
        except Exception as err:
            self.state.metrics.record_request("error", len(self.job.prompt_ids), 0, None)
            raise RequestError(f"generation failed: {err}", status=500, kind="server_error") from None
        text, reason, usage = self.finish(tokens, reason, spec)
        return {
            **self.envelope(self.choice(text, reason, delta=False), chunk=False),
            "usage": usage,
            **self.spec_fields(spec),
        }

    async def events(self, scheduler: BatchScheduler):
        updates: asyncio.Queue[list[int]] = asyncio.Queue()
        self.job.on_tokens = updates.put_nowait
        generation = asyncio.create_task(scheduler.submit(self.job))
        hold = max((len(s) for s in self.stops), default=1) - 1  # text that may still become a stop string
        sent = ""
        while not generation.done():
            update = asyncio.create_task(updates.get())
            await asyncio.wait({update, generation}, return_when=asyncio.FIRST_COMPLETED)
            if not update.done():
                update.cancel()
                break
            text, stopped = apply_stop(self.state.codec.decode(update.result()), self.stops)
            ready = text if stopped else text[: len(text) - hold].rstrip("\ufffd")
            if len(ready) > len(sent) and ready.startswith(sent):
                yield self.sse(self.envelope(self.choice(ready[len(sent) :], None, delta=True), chunk=True))
                sent = ready
        try:
            tokens, reason, spec = await generation
        except Exception as err:
            self.state.metrics.record_request("error", len(self.job.prompt_ids), 0, None)
            yield self.sse(RequestError(f"generation failed: {err}", status=500, kind="server_error").body())
            return
        text, reason, usage = self.finish(tokens, reason, spec)
        if len(text) > len(sent) and text.startswith(sent):
            yield self.sse(self.envelope(self.choice(text[len(sent) :], None, delta=True), chunk=True))
        final = self.envelope(self.choice("", reason, delta=True), chunk=True)
        yield self.sse({**final, "usage": usage, **self.spec_fields(spec)})
        yield "data: [DONE]\n\n"

    def spec_fields(self, spec: SpecMetrics) -> dict:
        """This request's speculative counters, when speculative decoding is on."""
        return {"spec_decode": spec.to_dict()} if self.state.metrics.speculative else {}

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"
