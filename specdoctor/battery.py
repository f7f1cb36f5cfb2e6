"""The correctness battery: the built-in 9 prompts (battery.jsonl), or a user's JSON-lines file."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from specdoctor.errors import SpecdoctorError


def load_battery(path: Path | None) -> list[dict]:
    """The built-in 9-prompt battery, or a user's: one JSON object per line with a "prompt"."""
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
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
            raise SpecdoctorError(f'{source}:{number}: expected an object with a non-empty "prompt" string')
        entries.append({"name": str(entry.get("name", f"prompt-{number}")), "prompt": entry["prompt"]})
    if not entries:
        raise SpecdoctorError(f"{source}: no prompts")
    return entries
