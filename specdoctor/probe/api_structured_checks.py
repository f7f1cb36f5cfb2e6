"""The API sweep's structured-output checks: OpenAI's `response_format` (`json_schema`, `json_object`) and vLLM's
`structured_outputs` (`regex`, `choice`), each at concurrency 1 and API_CONCURRENCY. A reply that finished ("stop")
must follow its constraint (JSON valid against the schema, the regex matched whole, one of the choices); greedy, the
two concurrencies must give the same replies, and with a reference the reference's. A reply cut by max_tokens is not
judged (a grammar may let a model write whitespace until it runs out), and where none finished the check is not run;
so is a check whose field the server ignores (every reply breaks the constraint and is the unconstrained reply).

The schema is checked again through the chat API behind a reasoning parser: the reasoning is the model's and free,
the grammar starts where it ends, inside a step's drafts as often as not (vllm#44006: the positions after the end
left unmasked). Each reply whose reasoning ended and that finished must have content valid against the schema; a
server that splits no reasoning from its chat replies does not run it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from specdoctor.probe.api_common import (
    API_CONCURRENCY,
    NOT_RUN,
    REFUSED,
    ApiCheck,
    Asker,
    Plain,
    parting,
    refused,
    refused_check,
    verdict_of,
)
from specdoctor.probe.client import first_choice
from specdoctor.probe.output_sweeps import TIE_MARGIN, output_text

STRUCTURED_TOKENS = 64
IGNORED = "the server ignores"  # the start of a not-run check's evidence where the field was not read
# Small and closed, so that a reply can finish well inside STRUCTURED_TOKENS.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer"},
    },
    "required": ["ok", "tag", "n"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,3}\."
CHOICES = ["alpha", "beta", "gamma delta"]
TYPES = {"boolean": bool, "integer": int, "object": dict}


@dataclass(frozen=True)
class Constraint:
    name: str  # the check's label
    fields: dict  # what the request sends
    breach: Callable[[str], str | None]  # why a finished reply's text breaks it, or None
    chat: bool = False  # sent as a chat message: judged on the content after the reasoning the server splits off


def json_breach(schema: dict | None) -> Callable[[str], str | None]:
    def breach(text: str) -> str | None:
        try:
            value = json.loads(text)
        except ValueError as err:
            return f"not JSON ({err}): {text[:80]!r}"
        return None if schema is None else schema_violation(value, schema)

    return breach


def regex_breach(text: str) -> str | None:
    return None if re.fullmatch(REGEX, text) else f"{text[:80]!r} does not match {REGEX!r}"


def choice_breach(text: str) -> str | None:
    return None if text in CHOICES else f"{text[:80]!r} is not one of {CHOICES}"


CONSTRAINTS = [
    Constraint(
        "response_format json_schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "specdoctor_probe", "schema": SCHEMA}}},
        json_breach(SCHEMA),
    ),
    Constraint("response_format json_object", {"response_format": {"type": "json_object"}}, json_breach(None)),
    Constraint("structured_outputs regex", {"structured_outputs": {"regex": REGEX}}, regex_breach),
    Constraint("structured_outputs choice", {"structured_outputs": {"choice": CHOICES}}, choice_breach),
]


REASONED = Constraint("json_schema after reasoning", CONSTRAINTS[0].fields, CONSTRAINTS[0].breach, chat=True)


def structured_checks(asker: Asker, prompts: list, plain: Plain) -> list[ApiCheck]:
    """Each constraint's check; the schema's after a reasoning unless the server ignores or refuses the schema."""
    checks = [structured_check(asker, prompts, plain, constraint) for constraint in CONSTRAINTS]
    schema = checks[0]
    if schema.verdict == NOT_RUN and schema.evidence.startswith((IGNORED, REFUSED)):
        checks.append(ApiCheck(REASONED.name, "structured", 0, NOT_RUN, f"as {schema.name}: {schema.evidence}"))
    else:
        checks.append(structured_check(asker, prompts, plain, REASONED))
    return checks


def structured_check(asker: Asker, prompts: list, plain: Plain, constraint: Constraint) -> ApiCheck:
    label, chat = constraint.name, constraint.chat
    requests = [asker.body(prompt, constraint.fields | {"max_tokens": STRUCTURED_TOKENS}) for prompt in prompts]
    batched = asker.ask(requests, chat=chat)
    if refusal := refused_check(label, "structured", batched):
        return refusal
    if chat and not any(first_choice(reply).get("reasoning") for reply in batched):
        why = "no chat reply carries a reasoning: the server runs no reasoning parser, or the prompt opens none"
        return ApiCheck(label, "structured", len(requests), NOT_RUN, why)
    theirs = asker.ask(requests, reference=True, chat=chat) if asker.reference else [None] * len(requests)
    uncompared = next((why for why, holds in uncomparable(theirs, chat) if holds), None)
    if uncompared:  # its own rules still hold: JSON, the schema, alone as in a batch
        theirs = [None] * len(requests)
    alone = asker.ask(requests, concurrency=1, chat=chat)
    if not chat and ignored(batched, plain.own, constraint):
        field = next(iter(constraint.fields))
        why = f"{IGNORED} {field}: every reply breaks it and is the reply without it"
        return ApiCheck(label, "structured", len(requests) * 2, NOT_RUN, why)
    cases, judged = [], 0
    for p, (reply, solo, reference) in enumerate(zip(batched, alone, theirs, strict=True)):
        for where, one in ((f"{API_CONCURRENCY} in flight", reply), ("alone", solo)):
            judged += judgeable(one)
            cases.append((f"prompt {p + 1}, {where}", structured_mismatch(one, constraint)))
        cases.append((f"prompt {p + 1}, alone against {API_CONCURRENCY} in flight", parted(solo, reply)))
        if reference is not None:
            cases.append((f"prompt {p + 1}, against speculation off", parted(reply, reference)))
    if not judged and not any(why for _, why in cases):
        ended = " with its reasoning ended" if chat else ""
        why = f"no reply finished{ended} within {STRUCTURED_TOKENS} tokens (the model wrote whitespace or ran on)"
        return ApiCheck(label, "structured", len(requests) * 2, NOT_RUN, why)
    checked = verdict_of(label, "structured", cases)
    if uncompared:
        checked.evidence += f"; not compared with speculation off: {uncompared}"
    return checked


def uncomparable(theirs: list[dict | None], chat: bool) -> list[tuple[str, bool]]:
    """(why, whether it holds) for each reason the reference's replies cannot stand for this check's: it refuses
    the field, or (a chat check) it splits no reasoning from them, so its grammar ran from the first token."""
    replies = [reply for reply in theirs if reply is not None]
    return [
        ("the reference refuses it", any(refused(reply) for reply in replies)),
        (
            "the reference splits no reasoning from its replies",
            chat and bool(replies) and not any(first_choice(reply).get("reasoning") for reply in replies),
        ),
    ]


def parted(reply: dict, other: dict) -> str | None:
    """Why two greedy replies to the same request differ (past a near tie), or None."""
    if "error" in reply or "error" in other:
        return reply.get("error") or other["error"]
    found = parting(reply, other)
    return None if found is None or found["gap"] <= TIE_MARGIN else f"the replies part at token {found['index']}"


def judgeable(reply: dict) -> bool:
    """The reply finished ("stop"), and where the server split off a reasoning, that reasoning ended (content)."""
    choice = first_choice(reply)
    return choice.get("finish_reason") == "stop" and choice.get("text") is not None


def structured_mismatch(reply: dict, constraint: Constraint) -> str | None:
    """Why a finished reply breaks its constraint, or None; a reply cut by max_tokens, or ended inside its
    reasoning, is not judged."""
    if "error" in reply:
        return reply["error"]
    return constraint.breach(output_text(reply)) if judgeable(reply) else None


def ignored(replies: list[dict], unconstrained: list[dict], constraint: Constraint) -> bool:
    """Every reply breaks the constraint (finished or not) and begins as the same prompt's reply without it does:
    the field was not read."""

    def same_start(one: str, other: str) -> bool:
        return one.startswith(other) or other.startswith(one)

    return all(
        "error" not in reply
        and constraint.breach(output_text(reply))
        and same_start(output_text(reply), output_text(free))
        for reply, free in zip(replies, unconstrained, strict=True)
    )


def schema_violation(value, schema: dict) -> str | None:
    """How a JSON value breaks SCHEMA's kind of schema (an object of required, typed or enumerated properties, no
    others), or None."""
    if "enum" in schema:
        return None if value in schema["enum"] else f"{value!r} is not one of {schema['enum']}"
    kind = TYPES[schema["type"]]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        return f"{value!r} is not of type {schema['type']}"
    if kind is not dict:
        return None
    missing = [key for key in schema.get("required", []) if key not in value]
    extra = [key for key in value if key not in schema["properties"]]
    if missing or (extra and schema.get("additionalProperties") is False):
        return f"properties missing {missing}, not allowed {extra}"
    return next(
        (why for key, item in value.items() if (why := schema_violation(item, schema["properties"][key]))), None
    )
