"""Servers the tests and benchmarks start as real processes on loopback: `specdoctor serve`."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SpecdoctorServer:
    """`specdoctor serve ARGS` on a free port, up once /health answers 200."""

    def __init__(self, *args: str, model: str = "demo", start_timeout_s: float = 120):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "specdoctor", "serve", "--model", model, "--port", str(self.port), *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + start_timeout_s
        while time.time() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    self.rank_pids = httpx.get(f"{self.url}/health").json()["rank_pids"]
                    return
            except httpx.HTTPError:
                time.sleep(0.5)
        raise AssertionError(f"server did not start: {self.process.communicate(timeout=30)}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)
