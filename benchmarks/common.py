"""What every benchmark shares: the machine description and writing its JSON, by default under
benchmarks/results/ (the files docs/performance.md cites), next to the table."""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
from rich.table import Table


def machine() -> str:
    text = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


RESULTS = Path(__file__).resolve().parent / "results"


def add_json_option(parser: argparse.ArgumentParser, name: str) -> None:
    """`--json FILE`, by default benchmarks/results/NAME.json (written relative to where the script runs, so a
    run from the repository's root records the path as the docs spell it)."""
    default = Path(os.path.relpath(RESULTS / f"{name}.json"))
    parser.add_argument("--json", type=Path, default=default, help=f"where the JSON goes (default: {default})")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2) + "\n")


def numeric_table(title: str, columns: tuple[str, ...]) -> Table:
    """A rich table with these right-aligned columns (every benchmark's figures line up by digit)."""
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    return table
