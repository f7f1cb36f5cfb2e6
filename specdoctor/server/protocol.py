"""OpenAI request schemas (the fields specdoctor honours), errors, and the chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

# Used when a checkpoint ships no chat template: one line per message, then the assistant's turn.
PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as OpenAI's API does

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | StrictInt = Field(default=1.0, ge=0, le=2)
    top_p: StrictFloat | StrictInt = Field(default=1.0, gt=0, le=1)
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr]

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise RequestError("only one prompt per request is supported", "prompt")
            return self.prompt[0]
        return self.prompt


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class RequestError(Exception):
    """A request the server refuses: becomes an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def chat_template(model_path: Path) -> str:
    """The checkpoint's own template (tokenizer_config.json's chat_template) or the plain one."""
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
