"""The checkpoint's own tokenizer (`tokenizer.json`, Hugging Face tokenizers format)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from specdoctor.errors import CheckpointError

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class TextCodec:
    def __init__(self, model_path: Path, config_eos: tuple[int, ...] = ()):
        path = model_path / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: tokenizer.json not found (needed to turn prompts into tokens)")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for unreadable files
            raise CheckpointError(f"{path}: cannot load tokenizer ({err})") from None
        eos = set(config_eos) | {i for name in EOS_NAMES if (i := self.tokenizer.token_to_id(name)) is not None}
        self.eos_token_ids = tuple(sorted(eos))

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
