"""The checkpoint's own tokenizer (`tokenizer.json`, Hugging Face tokenizers format)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from specdoctor.errors import CheckpointError

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def eos_token_ids(tokenizer: Tokenizer | None, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The config's EOS ids plus the tokenizer's end-of-text tokens."""
    found = {i for name in EOS_NAMES if tokenizer and (i := tokenizer.token_to_id(name)) is not None}
    return tuple(sorted(set(config_eos) | found))


def model_eos_token_ids(model_path: Path, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """EOS ids for a checkpoint directory, whether or not it ships a tokenizer."""
    path = model_path / "tokenizer.json"
    return eos_token_ids(Tokenizer.from_file(str(path)) if path.is_file() else None, config_eos)


class TextCodec:
    def __init__(self, model_path: Path, config_eos: tuple[int, ...] = ()):
        path = model_path / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer.json not found (needed to turn prompts into tokens)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for unreadable files
            raise CheckpointError(f"{path}: cannot load tokenizer ({err})") from None
        self.eos_token_ids = eos_token_ids(self.tokenizer, config_eos)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def read_prompt_file(path: Path) -> list[str]:
    """Prompts from a JSON-lines file: one object with a "prompt" field per line."""
    prompts = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read prompt file ({err.strerror})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f'{path}:{number}: expected a JSON object with a "prompt" string') from None
        if not isinstance(prompt, str) or not prompt:
            raise CheckpointError(f'{path}:{number}: "prompt" must be a non-empty string')
        prompts.append(prompt)
    return prompts
