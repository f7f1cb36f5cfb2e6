"""The HTTP API: OpenAI's completions, chat completions and models, plus /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint.tokenizer import TextCodec
from specdoctor.runtime.compile_status import compile_totals
from specdoctor.runtime.decode.grammar import GrammarRequest
from specdoctor.runtime.decode.requests import SequenceRequest
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.sampling import SamplingParams
from specdoctor.server.metrics import ServerMetrics
from specdoctor.server.protocol import ChatRequest, CompletionRequest, RequestError, render_chat
from specdoctor.server.reasoning import ReasoningTemplate
from specdoctor.server.reply import Reply
from specdoctor.server.scheduler import ContinuousScheduler, Job

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


@dataclass
class ServerState:
    engine: Engine
    codec: TextCodec
    model_name: str
    chat_template: str
    api_key: str | None
    metrics: ServerMetrics
    max_num_seqs: int = 32  # requests in the running batch at most
    max_waiting: int = 256  # requests queued for a place at most
    reasoning: ReasoningTemplate | None = None  # --reasoning-parser's


class StoppingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown (SIGTERM, Ctrl-C) first ends the requests in flight: uvicorn would wait
    for open streams to finish, however long, or cancel them past a timeout and print a traceback."""

    def __init__(self, config: uvicorn.Config, scheduler: ContinuousScheduler, on_listening: Callable[[], None]):
        super().__init__(config)
        self.scheduler, self.on_listening = scheduler, on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:  # bound and listening: a client that reads the announcement can connect
            self.on_listening()

    async def shutdown(self, sockets=None) -> None:
        self.scheduler.stop()
        await super().shutdown(sockets=sockets)


def serve_http(
    state: ServerState,
    host: str,
    port: int,
    on_listening: Callable[[], None],
    warm_up: Callable[[], None] | None = None,
) -> None:
    """Serve until stopped; `on_listening()` once the port is bound, then `warm_up()` (requests wait for it). A client
    that stops reading holds its stream open: it is closed after 5 s."""
    scheduler = ContinuousScheduler(state.engine, state.metrics, state.max_num_seqs, state.max_waiting, warm_up)
    config = uvicorn.Config(
        create_app(state, scheduler), host=host, port=port, log_level="warning", timeout_graceful_shutdown=5
    )
    server = StoppingServer(config, scheduler, on_listening)
    with contextlib.suppress(KeyboardInterrupt):  # the stop signal, raised again once shut down (as uvicorn.run)
        server.run()
    if not server.started:
        raise SpecdoctorError(f"the HTTP server on {host}:{port} did not start (uvicorn's error is above)")


def create_app(state: ServerState, scheduler: ContinuousScheduler) -> FastAPI:

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(scheduler.run())
        yield
        task.cancel()
        # Close the ranks here: on SIGTERM uvicorn re-raises the signal once this returns.
        await asyncio.to_thread(state.engine.close)

    app = FastAPI(title="specdoctor", lifespan=lifespan)

    add_error_handlers(app)

    # A dependency, not an HTTP middleware: Starlette's middleware wrapper reports a disconnect to a
    # streaming response, which would cancel its request.
    async def authorise(request: Request) -> None:
        if state.api_key and request.headers.get("authorization") != f"Bearer {state.api_key}":
            raise RequestError("invalid or missing API key", status=401, kind="authentication_error")

    api = APIRouter(prefix="/v1", dependencies=[Depends(authorise)])

    @app.get("/health")
    async def health():
        alive = state.engine.alive
        body = {"status": "ok" if alive else "unhealthy", "rank_pids": state.engine.rank_pids}
        if state.engine.options.compile:  # the graphs compiled behind serving
            totals = compile_totals(state.engine.compile_status)
            graphs = {"active": totals["active"], "pending": totals["pending"], "warming_up": not scheduler.started}
            body["graphs"] = graphs
        return JSONResponse(body, 200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        state.metrics.set_queue(len(scheduler.running), len(scheduler.waiting))
        state.metrics.set_compile(state.engine.compile_status)
        return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @api.get("/models")
    async def models():
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "specdoctor",
            "max_model_len": state.engine.config.max_position_embeddings,
        }
        return {"object": "list", "data": [card]}

    @api.post("/completions")
    async def completions(body: CompletionRequest):
        return await respond(body, body.prompts(), chat=False, default_max_tokens=DEFAULT_MAX_TOKENS)

    @api.post("/chat/completions")
    async def chat_completions(body: ChatRequest):
        prompt = render_chat(state.chat_template, body.messages)
        thinking = state.reasoning if state.reasoning and state.reasoning.open_after(prompt) else None
        return await respond(body, [prompt], chat=True, default_max_tokens=None, thinking=thinking)

    async def respond(
        body: CompletionRequest | ChatRequest,
        prompts: list,
        chat: bool,
        default_max_tokens: int | None,
        thinking: ReasoningTemplate | None = None,
    ):
        reply = Reply(state, body, make_jobs(state, body, prompts, default_max_tokens), chat, thinking)
        scheduler.enqueue(reply.jobs)  # before the response starts, so a full queue is still a 429
        if body.stream:
            return StreamingResponse(reply.events(scheduler), media_type="text/event-stream")
        return await reply.whole(scheduler)

    app.include_router(api)
    return app


def make_jobs(
    state: ServerState, body: CompletionRequest | ChatRequest, prompts: list, default_max_tokens: int | None
) -> list[Job]:
    """Validate a request into its jobs, n per prompt (choice index = prompt index * n + i); None as the
    default limit means: up to the context. A seeded request's choice i samples with seed + i, as vLLM's."""
    if body.model not in (None, state.model_name):
        raise RequestError(
            f"model {body.model!r} is not served here (serving {state.model_name!r})",
            "model",
            404,
            "not_found_error",
        )
    body.refuse_unimplemented()
    if not state.engine.alive:
        raise RequestError("the pipeline is down: a rank has died", status=503, kind="server_error")
    vocab = state.engine.config.vocab_size
    if any(not 0 <= token < vocab for token in body.stop_token_ids or ()):
        raise RequestError(f"stop_token_ids must be in [0, {vocab})", "stop_token_ids")
    stop_ids = tuple(body.stop_token_ids or ()) + (() if body.ignore_eos else state.engine.eos_token_ids)
    logprobs, grammar = body.logprob_count(), body.grammar()
    if body.stream and body.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs are not available when stream=True (as in vLLM)", "prompt_logprobs")
    jobs = []
    for prompt in prompts:
        ids = prompt_ids(state, prompt)
        context = state.engine.config.max_position_embeddings
        max_tokens = body.token_limit or min(default_max_tokens or context, context - len(ids))
        if len(ids) + max_tokens > context:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context of {context} tokens",
                "max_tokens",
            )
        adjustments = body.adjustments(vocab, max_tokens, limit_given=body.token_limit is not None)
        constrained = after_reasoning(state, prompt, grammar)
        for choice in range(body.n):
            seed = None if body.seed is None else body.seed + choice
            sampling = SamplingParams(float(body.temperature), max(0, body.top_k), float(body.top_p), seed)
            sequence = SequenceRequest(
                ids, max_tokens, sampling, stop_ids, logprobs, adjustments, constrained, body.prompt_logprobs
            )
            jobs.append(Job(sequence))
    return jobs


def after_reasoning(state: ServerState, prompt: str | list[int], grammar: GrammarRequest | None):
    """The grammar, waiting for the end of the reasoning where the prompt leaves one open (vLLM asks it of every
    request's prompt, completions too, decoded with its special tokens)."""
    if grammar is None or state.reasoning is None:
        return grammar
    text = prompt if isinstance(prompt, str) else state.codec.decode(prompt, skip_special_tokens=False)
    return dataclasses.replace(grammar, after=state.reasoning.end_ids) if state.reasoning.open_after(text) else grammar


def prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    ids = state.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    vocab = state.engine.config.vocab_size
    if any(not 0 <= token < vocab for token in ids):
        raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
    return ids


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
