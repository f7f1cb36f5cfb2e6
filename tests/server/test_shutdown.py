"""Stopping `specdoctor serve` with SIGTERM (a service manager, `kill`) or Ctrl-C (SIGINT to the terminal's whole
process group) at any point: before it serves (loading) it exits at once with 143 or 130; while it serves (its graphs
compiling behind it or not) it ends the requests in flight (open streams send their last chunk, finish reason "abort")
and exits with 0. Either way every rank stops, its compilers too, and nothing prints a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from tests.helpers.servers import free_port
from tests.helpers.signal_state import as_a_terminal_starts_it, signal_state
from tests.helpers.waiting import alive, wait_for

EXIT_CODES = {signal.SIGTERM: 143, signal.SIGINT: 130}


STARTED: list[Serve] = []


@pytest.fixture(autouse=True)
def no_server_left_behind():
    """A test that fails before it stops its server still ends it (its own session: pytest would not)."""
    yield
    while STARTED:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(STARTED.pop().process.pid, signal.SIGKILL)


class Serve:
    """`specdoctor serve` in a session of its own (so a signal can go to its process group, as a terminal's
    Ctrl-C does), its stderr collected line by line."""

    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        command = [sys.executable, "-m", "specdoctor", "serve", "--model", "demo", "--port", str(self.port), *args]
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True,
            preexec_fn=as_a_terminal_starts_it,
            env={**{k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}, **(env or {})},
        )  # fmt: skip
        STARTED.append(self)
        self.stderr: list[str] = []
        self.reader = threading.Thread(target=lambda: self.stderr.extend(self.process.stderr), daemon=True)
        self.reader.start()

    def wait_for_line(self, text: str, timeout_s: float) -> None:
        wait_for(lambda: "".join(self.stderr), lambda seen: text in seen, timeout_s, f"{text!r} on stderr")

    def health(self) -> int | None:
        """/health's status code; None where nothing listens."""
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code
        except httpx.TransportError:
            return None

    def group_left(self) -> list[int]:
        """The processes of the server's group still running: its fork server, ranks and compile workers."""
        group = self.process.pid  # a session of its own: its leader's pid is the group's id
        return [pid for pid in all_pids() if process_group(pid) == group and alive(pid)]

    def stop(self, signum: int, whole_group: bool) -> tuple[int, str]:
        if whole_group:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)
        try:
            code = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            tail = "".join(self.stderr)[-2000:]
            raise AssertionError(
                f"still running 30 s after the signal:\n{signal_state(self.process.pid)}\n{tail}"
            ) from None
        self.reader.join(timeout=10)
        return code, "".join(self.stderr)


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def assert_stopped_cleanly(server: Serve, signum: int, whole_group: bool, serving: bool = False) -> None:
    code, stderr = server.stop(signum, whole_group)
    assert code == (0 if serving else EXIT_CODES[signum]), stderr
    assert "Traceback" not in stderr and "Error" not in stderr and "leaked" not in stderr, stderr
    wait_for(server.group_left, lambda left: not left, 15, "every process the server started to exit")


# (signal, sent to the whole process group as a terminal does, or to the server alone as `kill` does)
SIGNALS = [(signal.SIGTERM, False), (signal.SIGINT, True)]


@pytest.mark.parametrize(("signum", "whole_group"), SIGNALS)
def test_stopped_while_loading(signum, whole_group):
    server = Serve("--no-compile")
    server.wait_for_line("loading demo", 60)
    assert_stopped_cleanly(server, signum, whole_group)


@pytest.mark.slow  # about 40 s each: Inductor's first generated code comes after half a minute of tracing
@pytest.mark.parametrize(("signum", "whole_group"), SIGNALS)
def test_stopped_while_compiling_behind_serving(signum, whole_group, tmp_path):
    server = Serve(env={"XDG_CACHE_HOME": str(tmp_path)})  # compiled by default; from an empty cache: minutes
    server.wait_for_line("warmed up", 60)
    wait_for(lambda: list(tmp_path.rglob("*.py")), bool, 90, "Inductor to write its first generated code")
    assert_stopped_cleanly(server, signum, whole_group, serving=True)  # its compilers too


@pytest.mark.parametrize(("signum", "whole_group"), SIGNALS)
def test_stopped_while_streaming(signum, whole_group):
    server = Serve("--no-compile")
    server.wait_for_line("serving demo on", 60)
    socket.create_connection(("127.0.0.1", server.port), timeout=10).close()  # announced once listening: not refused
    wait_for(server.health, lambda status: status == 200, 60, "/health to answer 200")
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    body = {"prompt": "def f(x):\n", "max_tokens": 1900, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url, json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        next(lines)  # a token has been decoded; the request is in the running batch
        assert_stopped_cleanly(server, signum, whole_group, serving=True)
        rest = [line.removeprefix("data: ") for line in lines if line]
    # The open stream was ended, not cut: its last chunk says so (vLLM's reason for a request it dropped).
    assert rest[-1] == "[DONE]", rest[-3:]
    last = json.loads(rest[-2])["choices"][0]
    assert last["finish_reason"] == "abort" and last["index"] == 0, rest[-2]
