"""A reasoning parser as vLLM's `--reasoning-parser hf` runs one (docs/engine-semantics.md §Reasoning): the
checkpoint's `response_template` (tokenizer_config.json, as transformers writes it) names the literals that open
and close the model's thinking. A chat prompt that leaves the thinking open gets its reply split at the first close
(`reasoning`, then `content`), and its structured output starts after the close's tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint.tokenizer import TextCodec

REASONING_PARSERS = ("hf",)  # vLLM's parser that reads the checkpoint's response_template
THINKING = "thinking"  # the template's field vLLM reads the reasoning's literals from


@dataclass(frozen=True)
class ReasoningTemplate:
    anchors: tuple[str, ...]  # where the last assistant turn starts (start_anchor)
    opens: tuple[str, ...]
    closes: tuple[str, ...]
    end_ids: tuple[tuple[int, ...], ...]  # each close's tokens, as vLLM finds them (one vocabulary entry, or encoded)

    def open_after(self, prompt: str) -> bool:
        """Whether the prompt's last assistant turn opens the thinking and does not close it."""
        start = max((prompt.rfind(anchor) + len(anchor) for anchor in self.anchors if anchor in prompt), default=0)
        turn = prompt[start:]
        opened = max((turn.rfind(literal) for literal in self.opens), default=-1)
        return opened >= 0 and not any(literal in turn[opened:] for literal in self.closes)

    def split(self, text: str) -> tuple[str, str | None]:
        """(reasoning, content) of a reply's text: split at the first close; content None while none appeared."""
        found = [(index, literal) for literal in self.closes if (index := text.find(literal)) >= 0]
        if not found:
            return text, None
        index, literal = min(found)
        return text[:index], text[index + len(literal) :]

    def settled(self, text: str) -> str:
        """The text a stream can send: while no close has appeared, not an end that could be a close's start."""
        if self.split(text)[1] is not None:
            return text
        starts = [n for literal in self.closes for n in range(1, len(literal)) if text.endswith(literal[:n])]
        return text[: len(text) - max(starts, default=0)]


def reasoning_template(parser: str, model_path: Path, codec: TextCodec) -> ReasoningTemplate:
    """`--reasoning-parser`'s template for a checkpoint; a SpecdoctorError saying what is missing."""
    if parser not in REASONING_PARSERS:
        raise SpecdoctorError(
            f"--reasoning-parser {parser!r} is not implemented (choose from {', '.join(REASONING_PARSERS)}: the "
            "checkpoint's response_template)"
        )
    where = model_path / "tokenizer_config.json"
    try:
        template = json.loads(where.read_text(encoding="utf-8")).get("response_template")
    except (OSError, ValueError, AttributeError):  # unreadable, not UTF-8 or not JSON, not an object
        template = None
    fields = template.get("fields") if isinstance(template, dict) else None
    thinking = fields.get(THINKING) if isinstance(fields, dict) else None
    if not isinstance(thinking, dict):
        raise SpecdoctorError(f"{where}: --reasoning-parser hf needs a response_template with a thinking field")
    literals = [literal_list(template, "start_anchor"), literal_list(thinking, "open"), literal_list(thinking, "close")]
    if not all(literals) or thinking.get("repeats"):
        raise SpecdoctorError(
            f"{where}: the response_template's start_anchor and thinking open and close must be literal strings, "
            "the thinking not repeated (patterns are not implemented)"
        )
    anchors, opens, closes = literals
    vocab = codec.tokenizer.get_vocab()
    end_ids = tuple(
        (vocab[literal],) if literal in vocab else tuple(codec.tokenizer.encode(literal, add_special_tokens=False).ids)
        for literal in closes
    )
    return ReasoningTemplate(anchors, opens, closes, end_ids)


def literal_list(spec: dict, key: str) -> tuple[str, ...]:
    """A template anchor's literals (a string, or a list of them); () when it is a pattern or missing."""
    value = spec.get(key)
    values = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    return tuple(values) if values and all(isinstance(v, str) and v for v in values) else ()
