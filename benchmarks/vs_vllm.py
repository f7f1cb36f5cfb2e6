"""specdoctor against vLLM 0.32's CPU build on the demo model, over HTTP, one server at a time.

    python -m benchmarks.vs_vllm [--max-tokens 32] [--speed-tokens 64] [--rounds 2] [--json FILE]

1. Per battery prompt (greedy, k 3, fp32, PP 1): vLLM's token ids against specdoctor's runtime, and
   each engine's drafts and accepted tokens for that request alone (vLLM: the /metrics difference
   around the request, sent alone).
2. Decoding speed, batch 1: the battery prompts sent one at a time, `--rounds` times, to vLLM's server
   and to `specdoctor serve`, with k 0 and k 3; tokens/s = completion tokens / wall time of the requests.
vLLM's peer environment is installed on first use (tests/peer/vllm_env.py).
"""

from __future__ import annotations

import argparse
import time

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.common import add_json_option, machine, write_json
from specdoctor.battery import load_battery
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import TextCodec
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from tests.helpers.servers import SpecdoctorServer
from tests.peer.vllm_server import VllmServer, completion_with_counters

K = 3


def tokens_per_second(url: str, prompts: list[str], max_tokens: int, rounds: int) -> float:
    """Text prompts: both servers tokenize them with the demo's tokenizer.json."""
    body = {"model": "demo", "max_tokens": max_tokens, "temperature": 0}
    httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompts[0], "max_tokens": 4}, timeout=120)  # warm-up
    tokens, started = 0, time.perf_counter()
    for _ in range(rounds):
        for prompt in prompts:
            reply = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt}, timeout=300).json()
            tokens += reply["usage"]["completion_tokens"]
    return tokens / (time.perf_counter() - started)


def per_prompt_rows(prompts: list[tuple[str, list[int]]], max_tokens: int) -> list[dict]:
    vllm = VllmServer(DEMO_DIR, K)
    try:
        theirs = {name: completion_with_counters(vllm.url, ids, max_tokens) for name, ids in prompts}
    finally:
        vllm.stop()
    with Engine(RuntimeOptions("demo", num_speculative_tokens=K)) as engine:
        ours = {name: engine.generate([ids], max_tokens) for name, ids in prompts}
    rows = []
    for name, _ in prompts:
        tokens, vllm_metrics = theirs[name]
        rows.append(
            {
                "prompt": name,
                "tokens_equal": tokens == ours[name].tokens[0],
                "vllm": vllm_metrics.to_dict(),
                "specdoctor": ours[name].row_metrics[0].to_dict(),
            }
        )
    return rows


def speed_rows(prompts, max_tokens: int, rounds: int) -> list[dict]:
    rows = []
    for k in (0, K):
        vllm = VllmServer(DEMO_DIR, k)
        try:
            vllm_speed = tokens_per_second(vllm.url, prompts, max_tokens, rounds)
        finally:
            vllm.stop()
        ours = SpecdoctorServer("--num-speculative-tokens", str(k))
        try:
            our_speed = tokens_per_second(ours.url, prompts, max_tokens, rounds)
        finally:
            ours.stop()
        rows.append({"k": k, "vllm_tokens_per_s": vllm_speed, "specdoctor_tokens_per_s": our_speed})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32, help="per prompt, for the per-prompt table")
    parser.add_argument("--speed-tokens", type=int, default=64, help="per prompt, for the speed table")
    parser.add_argument("--rounds", type=int, default=2)
    add_json_option(parser, "vs_vllm")
    args = parser.parse_args()
    codec = TextCodec(DEMO_DIR / "tokenizer.json", Checkpoint("demo").config.eos_token_ids)
    battery = [(entry["name"], codec.encode(entry["prompt"])) for entry in load_battery(None)]
    console = Console(width=150)

    prompt_rows = per_prompt_rows(battery, args.max_tokens)
    table = Table(title=f"vLLM 0.32 CPU vs specdoctor: battery, greedy, k {K}, {args.max_tokens} tokens, PP 1, fp32")
    for column in (
        "prompt",
        "tokens equal",
        "vLLM drafts",
        "vLLM accepted",
        "specdoctor drafts",
        "specdoctor accepted",
    ):
        table.add_column(column)
    for row in prompt_rows:
        vllm, ours = row["vllm"], row["specdoctor"]
        table.add_row(
            row["prompt"],
            "yes" if row["tokens_equal"] else "NO",
            *(str(side[key]) for side in (vllm, ours) for key in ("num_drafts", "num_accepted_tokens")),
        )
    console.print(table)

    speed = speed_rows([entry["prompt"] for entry in load_battery(None)], args.speed_tokens, args.rounds)
    table = Table(title=f"Over HTTP, batch 1: {len(battery)} prompts x {args.speed_tokens} tokens x {args.rounds}")
    for column in ("k", "vLLM tok/s", "specdoctor serve tok/s", "specdoctor / vLLM"):
        table.add_column(column, justify="right")
    for row in speed:
        ratio = row["specdoctor_tokens_per_s"] / row["vllm_tokens_per_s"]
        table.add_row(
            str(row["k"]), f"{row['vllm_tokens_per_s']:.1f}", f"{row['specdoctor_tokens_per_s']:.1f}", f"{ratio:.2f}x"
        )
    console.print(table)
    console.print(f"machine: {machine()}")
    write_json(args.json, {"settings": {**vars(args), "json": str(args.json)}, "prompts": prompt_rows, "speed": speed})


if __name__ == "__main__":
    main()
