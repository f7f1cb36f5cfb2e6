"""Serving under load: `specdoctor serve` against vLLM 0.32's CPU server, the same load, side by side.

    python -m benchmarks.serve_load [--streams 1 4 16] [--max-tokens 64] [--rounds 2] [--repeats 3]
        [--json FILE] [--servers NAME ...] [--baseline-checkout DIR]

The demo model, fp32, PP 1, greedy, MTP with k 3 on every server (`serve` with its adaptive speculation, and once
speculating every step). Every server is started first (an idle one takes no measurable CPU; start the compiled ones
from a filled compile cache, docs/performance.md: serving under load); then each load runs on
each server in turn, `--repeats` times, so that every server's runs of a load lie within a minute of each other and
this machine's slow and fast spells fall on all of them (the server order turns by one each repeat). For each number
of concurrent streams c, c clients each send the 9 battery prompts `--rounds` times, back to back, streamed
(`ignore_eos`, so every request makes `--max-tokens` tokens). Reported per server and c, the median over the
repeats: completion tokens/s over the wall time (and its range), time to first token (TTFT) and time per output
token after the first (TPOT = (last chunk - first chunk) / (tokens - 1) per request), p50 and p99, and the CPU
seconds each side spent per 1,000 tokens: the server's front process (HTTP, text, scheduling), its engine processes
(`serve`'s ranks, vLLM's engine core) and this client. `serve` against vLLM's better configuration: the ratio of the
medians, and its range over the repeats (each repeat's `serve` run against its best vLLM run). vLLM runs three ways:
with its CPU defaults (compute bound to one core, the other reserved), with both cores
(`VLLM_CPU_OMP_THREADS_BIND=0-1`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`), and with both cores and its dynamic speculation
set to k 0 past 4 rows (`num_speculative_tokens_per_batch_size`; at k 0 it still runs the drafter's first pass to
keep its cache). `--baseline-checkout DIR` adds `serve` with its defaults run from another source tree (a
`git worktree` of an earlier commit): a change's throughput against the code before it, in the same interleaved run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
from rich.console import Console

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from specdoctor.battery import load_battery
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from tests.helpers.servers import SpecdoctorServer
from tests.helpers.tool_env import PeerUnavailable
from tests.peer.vllm_server import VllmServer

K = 3
COMPILE_TIMEOUT_S = 3600
BOTH_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
SERVE_DEFAULTS = ("--num-speculative-tokens", str(K), "--adaptive-speculation")
ALWAYS_SPECULATE = ("--num-speculative-tokens", str(K), "--always-speculate")
PLAIN_PAST_4_ROWS = [(1, 4, K), (5, 1024, 0)]  # vLLM's dynamic speculation: k by the batch's rows
CPU_COLUMNS = {  # column: row key
    "front CPU s/1k tok": "front_cpu_s_per_1k_tokens",
    "engine CPU s/1k tok": "engine_cpu_s_per_1k_tokens",
    "client CPU s/1k tok": "client_cpu_s_per_1k_tokens",
}


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": "demo",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, chunks, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                chunks.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    tpot = (chunks[-1] - chunks[0]) / (tokens - 1) if tokens > 1 and len(chunks) > 1 else None
    return {"ttft": chunks[0] - sent, "tpot": tpot, "tokens": tokens}


async def drive(url: str, prompts: list[str], streams: int, max_tokens: int, rounds: int, pid: int) -> dict:
    """`streams` clients, each sending every prompt `rounds` times back to back, to the server whose front
    process is `pid`."""
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, url, prompts[0], 4)  # warm-up, not counted

        async def stream(offset: int) -> list[dict]:
            order = [prompts[(offset + i) % len(prompts)] for i in range(len(prompts) * rounds)]
            return [await one_request(client, url, prompt, max_tokens) for prompt in order]

        started, cpu_before, client_before = time.perf_counter(), cpu_seconds(pid), time.process_time()
        results = [r for per_stream in await asyncio.gather(*(stream(s) for s in range(streams))) for r in per_stream]
        wall = time.perf_counter() - started
        client_cpu, (front, engine) = time.process_time() - client_before, cpu_seconds(pid)
    per_1k_tokens = 1000 / sum(r["tokens"] for r in results)
    ttfts = sorted(r["ttft"] for r in results)
    tpots = sorted(r["tpot"] for r in results if r["tpot"] is not None)
    return {
        "streams": streams,
        "requests": len(results),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "tpot_p50_ms": 1000 * percentile(tpots, 50),
        "tpot_p99_ms": 1000 * percentile(tpots, 99),
        "front_cpu_s_per_1k_tokens": (front - cpu_before[0]) * per_1k_tokens,
        "engine_cpu_s_per_1k_tokens": (engine - cpu_before[1]) * per_1k_tokens,
        "client_cpu_s_per_1k_tokens": client_cpu * per_1k_tokens,
    }


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds used so far by a process and by its descendants (those alive now), from Linux's /proc."""
    tick = os.sysconf("SC_CLK_TCK")

    def own(pid: int) -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    def descendants(pid: int) -> list[int]:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:  # a process that ended since it was listed (a compile worker)
            return []
        children = []
        for task in tasks:
            with contextlib.suppress(OSError):  # a thread that ended since it was listed
                children += [int(child) for child in (task / "children").read_text().split()]
        return children + [d for child in children for d in descendants(child)]

    def alive(pid: int) -> float:
        with contextlib.suppress(OSError):  # a process that ended since it was listed (a compile worker)
            return own(pid)
        return 0.0

    engines = descendants(pid)
    if not engines:
        raise RuntimeError(f"the server {pid} has no engine process to measure")
    return own(pid), sum(alive(child) for child in engines)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


def servers(baseline: Path | None = None) -> list[tuple[str, Callable]]:
    """(name, start) of each server compared: `serve` compiled and eager, and compiled speculating every step; vLLM
    with its CPU defaults, both cores, and both cores with k 0 past 4 rows; `serve` from `baseline`, where given."""
    earlier = []
    if baseline:
        earlier = [(f"specdoctor serve at {baseline.name}", lambda: compiled(*SERVE_DEFAULTS, checkout=baseline))]
    return [
        # The defaults, compiled and adaptive (the test helper's are eager and always speculating: named here);
        # minutes from a cold cache.
        ("specdoctor serve", lambda: compiled(*SERVE_DEFAULTS)),
        ("specdoctor serve --no-compile", lambda: SpecdoctorServer(*SERVE_DEFAULTS, "--no-compile")),
        (
            "specdoctor serve --always-speculate",
            lambda: compiled("--num-speculative-tokens", str(K), "--always-speculate"),
        ),
        ("vLLM (CPU defaults)", lambda: VllmServer(DEMO_DIR, K)),
        ("vLLM (both cores)", lambda: VllmServer(DEMO_DIR, K, extra_env=BOTH_CORES)),
        (
            "vLLM (both cores, k 0 past 4 rows)",
            lambda: VllmServer(DEMO_DIR, K, extra_env=BOTH_CORES, schedule=PLAIN_PAST_4_ROWS),
        ),
    ] + earlier


def compiled(*flags: str, checkout: Path | None = None) -> SpecdoctorServer:
    """`serve --compile`, measured once its graphs, compiled behind serving, are all in (minutes from a cold cache;
    a checkout from before compiling behind serving compiles before it answers /health)."""
    server = SpecdoctorServer(*flags, "--compile", checkout=checkout, start_timeout_s=COMPILE_TIMEOUT_S)
    if "graphs" in httpx.get(f"{server.url}/health", timeout=30).json():
        server.wait_for_graphs(COMPILE_TIMEOUT_S)
    return server


def on_each_server(run: Callable[[str, int], list[dict]]) -> list[dict]:
    """`run(url, front process id)` against each of `servers()`, one server at a time; its rows labelled with the
    server's name."""
    rows = []
    for name, start in servers():
        server = start()
        try:
            rows += [{"server": name, **row} for row in run(server.url, server.process.pid)]
        finally:
            server.stop()
    return rows


@contextlib.contextmanager
def all_servers(names: list[str] | None = None, baseline: Path | None = None) -> Iterator[list[tuple[str, object]]]:
    """Every one of `servers(baseline)` (those named in `names`, where given) started, (name, server) in order; all
    stopped on leaving."""
    started = []
    try:
        for name, start in servers(baseline):
            if names and name not in names:
                continue
            try:
                server = start()
            except PeerUnavailable as failed:  # vLLM's CPU worker now and then dies compiling at start-up
                print(f"{name}: {failed}; starting it again", file=sys.stderr)
                server = start()
            started.append((name, server))
        yield started
    finally:
        for _, server in started:
            server.stop()


def interleaved(servers: list[tuple[str, object]], args: argparse.Namespace, prompts: list[str]) -> list[dict]:
    """Every load on every server, `args.repeats` times: a load runs on each server in turn, the order turned by one
    each repeat. One row per run, with its server's name and its repeat."""
    rows = []
    for repeat in range(args.repeats):
        turned = servers[repeat % len(servers) :] + servers[: repeat % len(servers)]
        for streams in args.streams:
            for name, server in turned:
                row = asyncio.run(drive(server.url, prompts, streams, args.max_tokens, args.rounds, server.process.pid))
                rows.append({"server": name, "repeat": repeat, **row})
    return rows


def medians(rows: list[dict]) -> list[dict]:
    """Per server and streams (in the servers' order), the median of each figure over the repeats, and the range of
    tokens/s."""
    summary = []
    for name in dict.fromkeys(row["server"] for row in rows):
        for streams in sorted({row["streams"] for row in rows}):
            runs = [row for row in rows if row["server"] == name and row["streams"] == streams]
            figures = [key for key, value in runs[0].items() if isinstance(value, float)]
            summary.append(
                {
                    "server": name,
                    "streams": streams,
                    **{key: statistics.median(run[key] for run in runs) for key in figures},
                    "tokens_per_s_range": (min(map(rate, runs)), max(map(rate, runs))),
                }
            )
    return summary


def against_vllm(rows: list[dict], summary: list[dict], streams: int, ours: str) -> tuple[str, float, float, float]:
    """(best vLLM server by median, ratio of the medians, lowest and highest ratio of one repeat's runs)."""
    best = max((r for r in summary if r["server"].startswith("vLLM") and r["streams"] == streams), key=rate)
    mine = next(r for r in summary if r["server"] == ours and r["streams"] == streams)
    per_repeat = []
    for repeat in sorted({row["repeat"] for row in rows}):
        runs = [row for row in rows if row["repeat"] == repeat and row["streams"] == streams]
        vllm = max(rate(row) for row in runs if row["server"].startswith("vLLM"))
        per_repeat.append(next(rate(row) for row in runs if row["server"] == ours) / vllm)
    return best["server"], rate(mine) / rate(best), min(per_repeat), max(per_repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each load on each server, interleaved")
    add_json_option(parser, "serve_load")
    parser.add_argument("--servers", nargs="+", help="only these servers, by name (default: all)")
    parser.add_argument("--baseline-checkout", type=Path, help="also `serve` run from this source tree")
    args = parser.parse_args()
    prompts = [entry["prompt"] for entry in load_battery(None)]
    with all_servers(args.servers, args.baseline_checkout) as started:
        rows = interleaved(started, args, prompts)
    summary = medians(rows)
    table = numeric_table(
        f"Serving load: demo, fp32, PP 1, k {K}, {args.max_tokens} tokens, battery x {args.rounds}, "
        f"median of {args.repeats} interleaved repeats",
        ("server", "streams", "tok/s", "tok/s range", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms")
        + tuple(CPU_COLUMNS),
    )
    for row in summary:
        low, high = row["tokens_per_s_range"]
        table.add_row(
            row["server"],
            str(row["streams"]),
            f"{rate(row):.1f}",
            f"{low:.1f}–{high:.1f}",
            *(f"{row[key]:.1f}" for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")),
            *(f"{row[key]:.3f}" for key in CPU_COLUMNS.values()),
        )
    console = Console(width=220)
    console.print(table)
    for streams in args.streams:
        for ours in dict.fromkeys(row["server"] for row in rows):
            if ours.startswith("specdoctor") and any(row["server"].startswith("vLLM") for row in rows):
                best, ratio, low, high = against_vllm(rows, summary, streams, ours)
                console.print(
                    f"{streams} streams: {ours} / best vLLM ({best}) = {ratio:.2f}x (one repeat: {low:.2f}–{high:.2f}x)"
                )
    console.print(f"machine: {machine()}")
    settings = {**vars(args), "json": str(args.json), "baseline_checkout": str(args.baseline_checkout)}
    write_json(args.json, {"settings": settings, "machine": machine(), "runs": rows, "summary": summary})


def rate(row: dict) -> float:
    return row["tokens_per_s"]


if __name__ == "__main__":
    main()
