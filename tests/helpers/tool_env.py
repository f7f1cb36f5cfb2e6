"""A tool the tests use as an oracle, in a virtual environment of its own (its pins clash with the test
environment's), installed once under .peer/ (git-ignored) and reused. A tool that cannot be installed
fails its tests with one line; they are never skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 1500


class PeerUnavailable(RuntimeError):
    """The tool could not be installed or started here."""


@dataclass(frozen=True)
class ToolEnv:
    name: str  # folder under .peer/
    requirements: tuple[str, ...]
    check: str  # Python that imports what the tests use
    without_deps: tuple[str, ...] = ()  # installed after, ignoring their own (stale) pins
    remove: tuple[str, ...] = ()  # pulled in by the requirements but breaking the import
    env_var: str = ""  # names a ready environment to reuse instead

    def directory(self) -> Path:
        return Path(os.environ.get(self.env_var) or ROOT / ".peer" / self.name)

    def python(self) -> Path:
        return self.directory() / "bin" / "python"

    def stamp(self) -> str:
        """What the `.ready` marker holds: the requirements it was installed with."""
        return " ".join(self.requirements + self.without_deps)

    def ready(self) -> bool:
        marker = self.directory() / ".ready"
        return marker.is_file() and marker.read_text().strip() == self.stamp() and self.python().is_file()

    def ensure(self) -> Path:
        """The interpreter of an environment where `check` runs, installing it if needed (once per session: a failed
        install is not tried again). One process installs at a time (the test run's workers all ask for it)."""
        if self.name in FAILED:
            raise PeerUnavailable(FAILED[self.name])
        if self.ready():
            return self.python()
        self.directory().parent.mkdir(parents=True, exist_ok=True)
        with FileLock(self.directory().with_name(f".{self.name}.lock")):
            return self.python() if self.ready() else self.install()

    def install(self) -> Path:
        python, marker = self.python(), self.directory() / ".ready"
        _run([sys.executable, "-m", "venv", "--clear", str(self.directory())], f"creating {self.directory()}")
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        _run(pip + list(self.requirements), f"pip install {' '.join(self.requirements)}")
        if self.without_deps:
            _run(pip + ["--no-deps", *self.without_deps], f"pip install --no-deps {' '.join(self.without_deps)}")
        if self.remove:  # ignore errors: absent packages are fine
            subprocess.run(
                [str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *self.remove], capture_output=True
            )
        _run([str(python), "-c", self.check], f"{self.check} in the {self.name} environment")
        marker.write_text(self.stamp() + "\n")
        return python


FAILED: dict[str, str] = {}  # environments whose install failed this session, and the one line saying why


def install_before_the_tests(envs: list[ToolEnv], say) -> None:
    """Install the environments the selected tests need before any of them starts (`say(line)`: progress), so no
    install runs under a test's timeout; a failure is one line naming the package, and the tests needing it fail
    with that line."""
    for env in envs:
        if env.ready():
            continue
        say(f"installing the {env.name} environment ({' '.join(env.requirements)}) for the tests that need it")
        started = time.monotonic()
        try:
            python = env.ensure()
            say(f"{env.name}: ready in {time.monotonic() - started:.0f} s ({python})")
        except PeerUnavailable as err:
            FAILED[env.name] = f"{env.name}: {err}"
            say(FAILED[env.name])


def _run(command: list[str], what: str) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"{what} took over {INSTALL_TIMEOUT_S} s") from None
    if result.returncode:
        lines = [line for line in (result.stderr + result.stdout).splitlines() if "ignored" not in line]
        raise PeerUnavailable(f"{what} failed: {lines[-1] if lines else f'exit {result.returncode}'}")


def install_main(env: ToolEnv) -> None:
    """`python -m <module>`: install the environment and print its interpreter (CI runs these first)."""
    try:
        print(env.ensure())
    except PeerUnavailable as err:
        print(f"{env.name}: {err}", file=sys.stderr)
        sys.exit(1)
