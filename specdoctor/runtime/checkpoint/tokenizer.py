"""The checkpoint's own tokenizer (`tokenizer.json`, Hugging Face tokenizers format)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from specdoctor.errors import CheckpointError

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"


def eos_token_ids(tokenizer: Tokenizer | None, config_eos: tuple[int, ...]) -> tuple[int, ...]:
    """The config's EOS ids plus the tokenizer's end-of-text tokens."""
    found = {i for name in EOS_NAMES if tokenizer and (i := tokenizer.token_to_id(name)) is not None}
    return tuple(sorted(set(config_eos) | found))


def tokenizer_file(model_path: Path, option: str | None = None) -> Path | None:
    """The tokenizer.json to use: `--tokenizer` (the file, or a directory holding it), else the
    checkpoint's own; None when there is neither."""
    if option:
        path = Path(option).expanduser()
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise CheckpointError(f"{option}: no {TOKENIZER_FILE} there (--tokenizer)")
        return file
    file = model_path / TOKENIZER_FILE
    return file if file.is_file() else None


def model_eos_token_ids(model_path: Path, config_eos: tuple[int, ...], option: str | None = None) -> tuple[int, ...]:
    """EOS ids for a checkpoint, whether or not a tokenizer comes with it."""
    file = tokenizer_file(model_path, option)
    return eos_token_ids(Tokenizer.from_file(str(file)) if file else None, config_eos)


def tokenizer_differences(draft_dir: Path, target_dir: Path) -> tuple[str | None, str | None]:
    """Where two checkpoints' tokenizers first give an id different tokens, said for people: (in the base
    vocabulary, with the added (special) tokens too); None where they agree, or where either ships no
    tokenizer.json (nothing to compare). Each file is read once."""
    files = [tokenizer_file(path) for path in (draft_dir, target_dir)]
    if None in files:
        return None, None
    draft, target = (TextCodec(file).tokenizer for file in files)
    base, full = (first_difference(draft.get_vocab(added), target.get_vocab(added)) for added in (False, True))
    return base, full


def first_difference(draft: dict[str, int], target: dict[str, int]) -> str | None:
    """The first id two vocabularies (token -> id) give different tokens."""
    tokens = [{i: token for token, i in vocab.items()} for vocab in (draft, target)]
    differing = next(
        (i for i in sorted(tokens[0].keys() | tokens[1].keys()) if tokens[0].get(i) != tokens[1].get(i)), None
    )
    if differing is None:
        return None
    theirs, ours = tokens[0].get(differing), tokens[1].get(differing)
    return f"its tokenizer has {theirs!r} at id {differing} where the target's has {ours!r}"


class TextCodec:
    def __init__(self, file: Path, config_eos: tuple[int, ...] = ()):
        try:
            self.tokenizer = Tokenizer.from_file(str(file))
        except Exception as err:  # tokenizers raises a bare Exception for unreadable files
            raise CheckpointError(f"{file}: cannot load tokenizer ({err})") from None
        self.eos_token_ids = eos_token_ids(self.tokenizer, config_eos)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_codec(checkpoint, option: str | None, needed_for: str | None = None) -> TextCodec | None:
    """The checkpoint's text codec (or `--tokenizer`'s). Without one: an error when text is `needed_for`
    something, else None (the caller falls back to token ids)."""
    file = tokenizer_file(checkpoint.path, option)
    if file is None:
        if needed_for:
            raise CheckpointError(
                f"{checkpoint.path}: no {TOKENIZER_FILE} (needed {needed_for}); point --tokenizer at one"
            )
        return None
    return TextCodec(file, checkpoint.config.eos_token_ids)


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
