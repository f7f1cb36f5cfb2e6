"""The correctness battery: the built-in 9 prompts (battery.jsonl), or a user's JSON-lines file, each
line {"prompt": "text"} or {"token_ids": [ids]}. A checkpoint without a tokenizer gets a battery of
token ids drawn from its vocabulary instead (`token_id_battery`)."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from specdoctor.errors import SpecdoctorError

TOKEN_BATTERY_PROMPTS = 9
TOKEN_BATTERY_LENGTH = 16
TOKEN_BATTERY_SEED = 0


def load_battery(path: Path | None) -> list[dict]:
    """The built-in 9-prompt battery, or a user's: one JSON object per line, with a "prompt" or "token_ids"."""
    if path is None:
        lines = resources.files("specdoctor").joinpath("battery.jsonl").read_text(encoding="utf-8").splitlines()
        source = "built-in battery"
    else:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise SpecdoctorError(f"{path}: cannot read battery ({err.strerror})") from None
        source = str(path)
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            raise SpecdoctorError(f"{source}:{number}: not valid JSON") from None
        fields = prompt_field(entry, f"{source}:{number}")  # raises unless an object with a prompt
        entries.append({"name": str(entry.get("name", f"prompt-{number}")), **fields})
    if not entries:
        raise SpecdoctorError(f"{source}: no prompts")
    return entries


def prompt_of(entry: dict) -> str | list[int]:
    """What a battery entry sends: its text, or its token ids."""
    return entry.get("prompt", entry.get("token_ids"))


def prompt_field(entry, where: str) -> dict:
    """{"prompt": text} or {"token_ids": ids} from one battery line, checked."""
    if isinstance(entry, dict) and isinstance(entry.get("prompt"), str) and entry["prompt"]:
        return {"prompt": entry["prompt"]}
    ids = entry.get("token_ids") if isinstance(entry, dict) else None
    if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return {"token_ids": ids}
    raise SpecdoctorError(f'{where}: expected an object with a non-empty "prompt" string or "token_ids" list')


def token_id_battery(vocab_size: int, excluded: tuple[int, ...]) -> list[dict]:
    """9 prompts of 16 token ids drawn uniformly from the vocabulary (EOS ids excluded) with a fixed seed:
    the same battery for every model of that vocabulary, with no tokenizer needed."""
    import torch

    allowed = torch.tensor([i for i in range(vocab_size) if i not in set(excluded)])
    generator = torch.Generator().manual_seed(TOKEN_BATTERY_SEED)
    draws = torch.randint(0, len(allowed), (TOKEN_BATTERY_PROMPTS, TOKEN_BATTERY_LENGTH), generator=generator)
    return [{"name": f"token-ids-{n + 1}", "token_ids": allowed[row].tolist()} for n, row in enumerate(draws)]


def battery_token_ids(entries: list[dict], codec) -> list[list[int]]:
    """Each entry's prompt as token ids; text needs a codec (a tokenizer)."""
    prompts = []
    for entry in entries:
        if "token_ids" in entry:
            prompts.append(entry["token_ids"])
        elif codec is None:
            raise SpecdoctorError(f"battery prompt {entry['name']!r} is text, but there is no tokenizer (--tokenizer)")
        else:
            prompts.append(codec.encode(entry["prompt"]))
    return prompts


def battery_prompts(path: Path | None, checkpoint, codec) -> tuple[list[list[int]], str | None]:
    """The battery as token ids, and a warning when it had to fall back to token ids (no tokenizer)."""
    if codec is None and path is None:
        eos = checkpoint.config.eos_token_ids
        warning = (
            f"no tokenizer.json: the battery is {TOKEN_BATTERY_PROMPTS} prompts of {TOKEN_BATTERY_LENGTH} token ids "
            f"drawn from the vocabulary (seed {TOKEN_BATTERY_SEED}), not text; --tokenizer PATH gives the text battery"
        )
        return battery_token_ids(token_id_battery(checkpoint.config.vocab_size, eos), None), warning
    return battery_token_ids(load_battery(path), codec), None
