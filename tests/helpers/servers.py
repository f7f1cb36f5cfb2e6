"""Servers the tests and benchmarks start as real processes on loopback: `specdoctor serve`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SpecdoctorServer:
    """`specdoctor serve ARGS` on a free port, up once /health answers 200."""

    def __init__(
        self,
        *args: str,
        model: str = "demo",
        start_timeout_s: float = 120,
        env: dict | None = None,
        checkout: Path | None = None,
    ):
        """`checkout`: run the specdoctor of that source tree (another commit's, for a benchmark's baseline)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if not {"--compile", "--no-compile", "--enforce-eager"} & set(args):
            args = ("--no-compile", *args)  # eager unless asked: a cold compile takes minutes on 2 cores
        if not {"--adaptive-speculation", "--always-speculate"} & set(args):
            args = ("--always-speculate", *args)  # unless asked: counters that follow each request, not the load
        command = [sys.executable, "-m", "specdoctor", "serve", "--model", model, "--port", str(self.port), *args]
        inherited = dict(os.environ)
        if env and "XDG_CACHE_HOME" in env:  # a compile cache of its own: not one a test process left set
            inherited.pop("TORCHINDUCTOR_CACHE_DIR", None)
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**inherited, **(env or {})},
            cwd=checkout,  # `-m` puts the working directory first on the path: its package wins
        )
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                health = httpx.get(f"{self.url}/health", timeout=1)
                if health.status_code == 200:
                    self.rank_pids = health.json()["rank_pids"]
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.2)  # between polls, whatever the answer was
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # it stops its ranks, then its output can be read
        output = self.process.communicate(timeout=60)
        raise AssertionError(f"server did not answer /health with 200 within {start_timeout_s:g} s: {output}")

    def wait_for_graphs(self, timeout_s: float) -> dict:
        """Until /health says the warm-up ran and no graph is pending (`serve --compile` compiles behind serving);
        its `graphs` then."""
        from tests.helpers.waiting import wait_for

        return wait_for(
            lambda: httpx.get(f"{self.url}/health", timeout=30).json()["graphs"],
            lambda graphs: not graphs["warming_up"] and not graphs["pending"],
            timeout_s,
            "every graph to compile behind serving",
            interval_s=1.0,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)


def probe(url: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`specdoctor probe --url URL ARGS`, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "specdoctor", "probe", "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
