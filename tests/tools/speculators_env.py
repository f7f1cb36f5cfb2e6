"""The `speculators` package, the EAGLE-3 tests' oracle, in a virtual environment of its own: it pins
transformers <= 5.19 and pulls torchvision and torchaudio, whose builds do not match torch 2.13 and break
transformers' import (they are removed; speculators' models do not use them).

    python -m tests.tools.speculators_env    # install (CI runs this before the tests); prints the interpreter
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.helpers.tool_env import ToolEnv, install_main

TOOL_TIMEOUT_S = 300

SPECULATORS = ToolEnv(
    name="speculators",
    requirements=("torch==2.13.0", "speculators==0.9.0"),
    check="from speculators.models.eagle3 import Eagle3DraftModel",
    remove=("torchvision", "torchaudio"),
    env_var="SPECDOCTOR_SPECULATORS_VENV",
)


def run_speculators(script: Path, *args: str) -> None:
    """One of the tests' scripts run by the speculators environment's interpreter; a failure raises with the
    last line it wrote."""
    result = subprocess.run(
        [str(SPECULATORS.ensure()), str(script), *args], capture_output=True, text=True, timeout=TOOL_TIMEOUT_S
    )
    if result.returncode:
        raise RuntimeError(f"{script.name} {args[0]} failed: {result.stderr.strip().splitlines()[-1]}")


if __name__ == "__main__":
    install_main(SPECULATORS)
