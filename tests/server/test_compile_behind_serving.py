"""`serve` compiles behind serving: it answers from the first request, eager, while each rank compiles its graphs,
then runs them; a compile killed halfway leaves those passes eager with a warning, never a crash, and never a graph in
the cache that a later start cannot load."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from specdoctor.runtime.launch import stat_fields
from tests.helpers.servers import SpecdoctorServer
from tests.helpers.waiting import wait_for

GREEDY = {"prompt": "def main(", "max_tokens": 24, "temperature": 0}


def compile_gauges(url: str) -> dict[str, float]:
    """/metrics' specdoctor:compile_* gauges, by name (active, pending, compiled, loaded, failed)."""
    gauges = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("specdoctor:compile_"):
            name, value = line.split("{", 1)[0].removeprefix("specdoctor:compile_"), line.rsplit(" ", 1)[1]
            gauges[name] = float(value)
    return gauges


def text(url: str) -> str:
    reply = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def compilers_of(pid: int) -> list[int]:
    """The C++ compilers (cc1plus) a rank's compile thread runs, its grandchildren."""
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    parents = {child: int(fields[1]) for child in pids if len(fields := stat_fields(child)) > 1}
    found = []
    for child in pids:
        try:
            name = open(f"/proc/{child}/comm").read().strip()
        except OSError:
            continue
        if name == "cc1plus" and parents.get(parents.get(child, 0)) == pid:
            found.append(child)
    return found


@pytest.mark.slow  # a minute or two of a cold compile
@pytest.mark.timeout(900)
def test_a_compile_killed_halfway_leaves_its_passes_eager_and_the_cache_whole(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}  # an empty compile cache
    server = SpecdoctorServer("--compile", env=env)
    try:
        expected = text(server.url)  # at once, eager: nothing is compiled yet
        assert compile_gauges(server.url)["active"] == 0
        health = httpx.get(f"{server.url}/health", timeout=10).json()["graphs"]
        assert not health["warming_up"] and health["active"] == 0 and health["pending"] > 0
        deadline = time.monotonic() + 300
        while not compile_gauges(server.url)["failed"]:  # the rank's compiler killed until a compile fails
            assert time.monotonic() < deadline, "no compile failed"
            for compiler in compilers_of(server.rank_pids[0]):
                os.kill(compiler, signal.SIGKILL)
            time.sleep(0.1)
        assert text(server.url) == expected  # eager where the compile failed; the rank serves on
        wait_for(lambda: compile_gauges(server.url), lambda gauges: gauges["active"] > 0, 600, "a graph to swap in")
        assert text(server.url) == expected  # compiled passes now, the same tokens
    finally:
        server.stop()
    stderr = server.process.stderr.read()
    assert "a compile failed" in stderr and "Traceback" not in stderr, stderr[-3000:]
    graphs = list(tmp_path.rglob("*.graph"))
    assert graphs
    again = SpecdoctorServer("--compile", env=env)
    try:  # a later start loads every graph the cache holds: none was left half-written
        wait_for(lambda: compile_gauges(again.url), lambda gauges: gauges["loaded"] == len(graphs), 120, "the loads")
        assert text(again.url) == expected
    finally:
        again.stop()
