"""OpenAI request schemas (the fields specdoctor honours), errors, and the chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from specdoctor.runtime.decode.adjustments import LogitAdjustments
from specdoctor.runtime.decode.grammar import GrammarRequest

# Used when a checkpoint ships no chat template: one line per message, then the assistant's turn.
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


MAX_CHOICES = 16  # n per request
MAX_LOGPROBS = 20  # top alternatives per token, vLLM's default --max-logprobs


# OpenAI's and vLLM's request fields that change the output and that this server does not implement, each with the
# values that change nothing: asked for with any other value, the request is refused with a 400 naming the field
# (an engine that ignored it would answer with output that silently ignores it). Other unknown fields stay ignored,
# as OpenAI's API ignores them.
UNIMPLEMENTED_FIELDS: dict[str, tuple] = {
    "min_p": (0,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "best_of": (1,),
    "use_beam_search": (False,),
    "echo": (False,),
    "suffix": ("",),
    "include_stop_str_in_output": (False,),
    "truncate_prompt_tokens": (),
    "logits_processors": ([],),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "prediction": (),
    "reasoning_effort": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
}

StopString = Annotated[StrictStr, Field(min_length=1)]  # vLLM refuses an empty one: it would stop at once


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint. Its other options (whitespace, structural tags, the
    backend) are refused as unknown keys rather than ignored."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | StrictStr | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = Field(default=None, min_length=1)
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    def request(self) -> GrammarRequest:
        given = {
            "json": self.json_ if isinstance(self.json_, str) or self.json_ is None else json.dumps(self.json_),
            "regex": self.regex,
            "choice": None if self.choice is None else json.dumps(self.choice),
            "grammar": self.grammar,
            "json_object": "" if self.json_object else None,
        }
        kinds = [(kind, spec) for kind, spec in given.items() if spec is not None]
        if len(kinds) != 1:
            raise RequestError(
                f"structured_outputs needs exactly one of {', '.join(given)}; sent {len(kinds)}", "structured_outputs"
            )
        return GrammarRequest(*kinds[0])


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to be checked against UNIMPLEMENTED_FIELDS, then ignored

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)  # OpenAI's newer name; wins when both
    temperature: StrictFloat | StrictInt = Field(default=1.0, ge=0, le=2)
    top_p: StrictFloat | StrictInt = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=0, ge=-1)  # vLLM's extension: 0 or -1 keep every token
    seed: StrictInt | None = None
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[StrictInt] | None = None  # vLLM's extension: these ids end the request too
    ignore_eos: StrictBool = False  # vLLM's extension: generate past the model's end-of-sequence ids
    return_tokens_as_token_ids: StrictBool = False  # vLLM's extension: log-probability entries named "token_id:N"
    return_token_ids: StrictBool = False  # vLLM's extension: each choice carries its prompt's and its output's ids
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    # Applied to the target's logits at every verified position (runtime/decode/adjustments.py), in vLLM's bounds.
    presence_penalty: StrictFloat | StrictInt = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: StrictFloat | StrictInt = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: StrictFloat | StrictInt = Field(default=1.0, gt=0, allow_inf_nan=False)
    min_tokens: StrictInt = Field(default=0, ge=0)
    logit_bias: dict[str, StrictFloat | StrictInt] | None = None  # token id (as a string) -> bias in [-100, 100]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's: each prompt token's log-probability (from the second) and this many top alternatives; not streamed.
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Structured output (runtime/decode/grammar.py): OpenAI's field, or vLLM's; not both.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    def grammar(self) -> GrammarRequest | None:
        """What the output must match, compiled once here so that a grammar xgrammar refuses is a 400 naming it."""
        wanted, field = None, "structured_outputs"
        if self.structured_outputs is not None:
            wanted = self.structured_outputs.request()
        if self.response_format is not None and self.response_format.type != "text":
            if wanted is not None:
                raise RequestError("send response_format or structured_outputs, not both", "response_format")
            wanted, field = self.response_format_grammar(), "response_format"
        if wanted is not None:
            try:
                wanted.grammar()
            except ValueError as error:
                raise RequestError(f"{field}: {error}", field) from None
        return wanted

    def response_format_grammar(self) -> GrammarRequest:
        if self.response_format.type == "json_object":
            return GrammarRequest("json_object")
        if self.response_format.json_schema is None:
            raise RequestError("response_format json_schema needs its json_schema", "response_format")
        return GrammarRequest("json", json.dumps(self.response_format.json_schema.json_schema))

    def refuse_unimplemented(self) -> None:
        """A 400 naming the first field this server does not implement, sent with a value that changes the output."""
        for name, value in (self.model_extra or {}).items():
            neutral = UNIMPLEMENTED_FIELDS.get(name)
            if neutral is not None and value is not None and value not in neutral:
                values = " or ".join(repr(v) for v in neutral) or "null"
                sent = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
                raise RequestError(
                    f"{name} is not implemented by specdoctor serve and would change the output: leave it out (or "
                    f"send {values}); sent {sent}",
                    name,
                )

    def adjustments(self, vocab: int, max_tokens: int, limit_given: bool) -> LogitAdjustments:
        """The logit adjustments asked for, as vLLM reads them: biases clamped to [-100, 100], the last of a token's
        keys winning."""
        if self.min_tokens > max_tokens:
            limit = "max_tokens" if limit_given else "the room the context leaves (no max_tokens was sent)"
            raise RequestError(f"min_tokens ({self.min_tokens}) must be at most {limit}: {max_tokens}", "min_tokens")
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < vocab:
                raise RequestError(f"logit_bias: {key!r} is not a token id in [0, {vocab})", "logit_bias")
            bias[token] = min(100.0, max(-100.0, float(value)))
        return LogitAdjustments(
            tuple(bias.items()),
            self.min_tokens,
            float(self.repetition_penalty),
            float(self.frequency_penalty),
            float(self.presence_penalty),
        )

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    # Text, token ids, or a list of either: one choice (n of them) per prompt, as OpenAI's schema has it.
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(item, int) for item in self.prompt):
            return [self.prompt]
        if not self.prompt:
            raise RequestError("the prompt list is empty", "prompt")
        return list(self.prompt)

    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprob_count(self) -> int | None:
        """Top alternatives per token (0: only the chosen token's log-probability); None: none asked for."""
        return self.logprobs


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class RequestError(Exception):
    """A request the server refuses: becomes an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def chat_template(model_path: Path) -> str:
    """The checkpoint's own template or the plain one. As transformers loads it: chat_template.jinja (where
    transformers 5 saves it) before tokenizer_config.json's chat_template."""
    own_file = model_path / "chat_template.jinja"
    if own_file.is_file():
        return own_file.read_text(encoding="utf-8")
    config = model_path / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, OSError, AttributeError):
            template = None
        if isinstance(template, str) and template:
            return template
    return PLAIN_CHAT_TEMPLATE


def render_chat(template: str, messages: list[ChatMessage]) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(trim_blocks=False, lstrip_blocks=False)
    rendered = environment.from_string(template).render(
        messages=[m.model_dump() for m in messages], add_generation_prompt=True
    )
    return rendered
