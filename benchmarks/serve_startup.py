"""The first start: how long `specdoctor serve` (its defaults: compiled, adaptive speculation) takes to answer /health
and its first completion from an empty compile cache, at PP 1, 2 and 4, on a quiet machine and with both cores busy;
then, once per PP, how long its graphs take to compile behind serving and a warm start (the cache filled).

    python -m benchmarks.serve_startup [--pp 1 2 4] [--rounds 3] [--busy 0 2] [--json FILE]

Each start is timed from launching the process: to its first /health 200 (the ranks loaded, the drafter checked),
and to the end of its first completion (16 tokens, greedy; it waits for the eager warm-up of every batch shape, which
runs before the first request joins). Each cold start uses a new, empty cache directory. `--busy N` runs N processes
that spin on the CPU for the whole of those starts, as a second test run would (2 on 2 cores: every core busy).
Medians over `--rounds`. Then, on a quiet machine, one start per PP is followed until /health says every graph is in
(compiled behind serving), and a second start on that cache is timed to its graphs loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from tests.helpers.servers import SpecdoctorServer

FLAGS = ("--num-speculative-tokens", "3", "--adaptive-speculation", "--compile")  # serve's defaults, named
COMPILE_TIMEOUT_S = 3600  # minutes of Inductor on 2 cores


@contextlib.contextmanager
def busy(processes: int):
    """`processes` processes spinning on the CPU until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def start(pp: int, cache: Path) -> tuple[SpecdoctorServer, float, float]:
    """(the server, seconds to /health 200, seconds to its first completion's end), from launching it."""
    began = time.perf_counter()
    server = SpecdoctorServer(*FLAGS, "--pp", str(pp), env={"XDG_CACHE_HOME": str(cache)}, start_timeout_s=600)
    health = time.perf_counter() - began
    body = {"prompt": "def main(", "max_tokens": 16, "temperature": 0}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return server, health, time.perf_counter() - began


def graphs_in(server: SpecdoctorServer, began: float) -> dict:
    """Seconds from `began` until every graph is in; the graphs then."""
    return {"seconds": time.perf_counter() - began, **server.wait_for_graphs(COMPILE_TIMEOUT_S)}


def cold_starts(pp: int, rounds: int, spinners: int) -> dict:
    health, completion = [], []
    with busy(spinners):
        for _ in range(rounds):
            with tempfile.TemporaryDirectory(prefix="specdoctor-cache-") as cache:
                server, to_health, to_completion = start(pp, Path(cache))
                server.stop()
            health.append(to_health)
            completion.append(to_completion)
    return {
        "pp": pp,
        "busy": spinners,
        "health_s": statistics.median(health),
        "first_completion_s": statistics.median(completion),
        "health_rounds": health,
        "completion_rounds": completion,
    }


def compile_and_warm_start(pp: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="specdoctor-cache-") as cache:
        began = time.perf_counter()
        server, _, _ = start(pp, Path(cache))
        cold = graphs_in(server, began)
        server.stop()
        began = time.perf_counter()
        server, health, _ = start(pp, Path(cache))
        warm = graphs_in(server, began)
        server.stop()
    return {"pp": pp, "compiled_s": cold["seconds"], "graphs": cold["active"], "warm_health_s": health, "warm": warm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 2], help="spinning processes, one load each")
    parser.add_argument("--no-compile-timing", action="store_true", help="skip the compile and warm-start runs")
    add_json_option(parser, "serve_startup")
    args = parser.parse_args()
    starts = [cold_starts(pp, args.rounds, spinners) for spinners in args.busy for pp in args.pp]
    compiles = [] if args.no_compile_timing else [compile_and_warm_start(pp) for pp in args.pp]
    write_json(args.json, {"flags": FLAGS, "starts": starts, "compiles": compiles})
    console = Console()
    table = numeric_table(
        f"specdoctor serve --model demo, cold compile cache: launch to /health 200 and to a first completion "
        f"({machine()}; medians of {args.rounds})",
        ("PP", "busy processes", "/health s", "first completion s", "rounds (/health; completion)"),
    )
    for row in starts:
        rounds = " ".join(f"{s:.1f}" for s in row["health_rounds"])
        rounds += "; " + " ".join(f"{s:.1f}" for s in row["completion_rounds"])
        table.add_row(str(row["pp"]), str(row["busy"]), f"{row['health_s']:.1f}", f"{row['first_completion_s']:.1f}",
                      rounds)  # fmt: skip
    console.print(table)
    if compiles:
        table = numeric_table(
            "graphs compiled behind serving (quiet machine), then a warm start on that cache",
            ("PP", "graphs", "every graph in, s", "warm: /health s", "warm: every graph loaded, s"),
        )
        for row in compiles:
            table.add_row(str(row["pp"]), str(row["graphs"]), f"{row['compiled_s']:.0f}",
                          f"{row['warm_health_s']:.1f}", f"{row['warm']['seconds']:.1f}")  # fmt: skip
        console.print(table)


if __name__ == "__main__":
    main()
