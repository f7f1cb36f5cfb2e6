"""Bursts of concurrent requests at a server that has just started: does any request wait on something other
than the model (a compile, a pause of the process)? `specdoctor serve` against vLLM 0.32's CPU server, one server
at a time, the servers of `benchmarks/serve_load.py`.

    python -m benchmarks.serve_bursts [--streams 16] [--bursts 4] [--max-tokens 64] [--json FILE]

Each server answers one short request (as serve_load warms up), then `--bursts` bursts one after another: c
requests sent at once (the battery prompts, shifted by one per burst; streamed, `ignore_eos`), the next burst once
all have finished. Per burst: time to first token (TTFT) median and slowest, and completion tokens/s over the
burst. The bursts differ only in what prefix caching (on in `serve` and vLLM) restores: the first computes the
battery prompts (a prompt pass of a few milliseconds), later ones find them cached. A first burst slower by far
more than that is start-up work left for the first requests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
from rich.console import Console

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from benchmarks.serve_load import K, on_each_server, one_request
from specdoctor.battery import load_battery


async def bursts(url: str, prompts: list[str], streams: int, count: int, max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, url, prompts[0], 4)  # warm-up, not counted
        rows = []
        for burst in range(count):
            sent = [prompts[(burst + i) % len(prompts)] for i in range(streams)]
            started = time.perf_counter()
            results = await asyncio.gather(*(one_request(client, url, p, max_tokens) for p in sent))
            wall = time.perf_counter() - started
            ttfts = [1000 * r["ttft"] for r in results]
            rows.append(
                {
                    "burst": burst + 1,
                    "ttft_median_ms": statistics.median(ttfts),
                    "ttft_max_ms": max(ttfts),
                    "tokens_per_s": sum(r["tokens"] for r in results) / wall,
                }
            )
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    add_json_option(parser, "serve_bursts")
    args = parser.parse_args()
    prompts = [entry["prompt"] for entry in load_battery(None)]
    rows = on_each_server(
        lambda url, _pid: asyncio.run(bursts(url, prompts, args.streams, args.bursts, args.max_tokens))
    )
    table = numeric_table(
        f"Bursts of {args.streams} requests after start: demo, fp32, PP 1, k {K}, {args.max_tokens} tokens",
        ("server", "burst", "TTFT median ms", "TTFT slowest ms", "tok/s"),
    )
    for row in rows:
        table.add_row(
            row["server"],
            str(row["burst"]),
            f"{row['ttft_median_ms']:.1f}",
            f"{row['ttft_max_ms']:.1f}",
            f"{row['tokens_per_s']:.1f}",
        )
    console = Console(width=120)
    console.print(table)
    console.print(f"machine: {machine()}")
    write_json(args.json, {"settings": {**vars(args), "json": str(args.json)}, "rows": rows})  # and the machine


if __name__ == "__main__":
    main()
