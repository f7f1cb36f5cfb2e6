"""Does a seeded request give the same text twice on vLLM's CPU build, with speculation (MTP k 3) and without?

    python -m benchmarks.vllm_seed [--json FILE]

The demo, fp32, eager: the battery's first 3 prompts at temperature 0.8, top-p 0.95, seed 1234, 16 tokens, each
sent twice, at concurrency 1 and 6 and with n 1 and 2; per case, the prompts whose choices came back the same.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import httpx
from rich.console import Console

from benchmarks.common import add_json_option, write_json
from specdoctor.battery import load_battery, prompt_of
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from tests.peer.vllm_server import VllmServer

PROMPTS = 3


def texts(url: str, body: dict) -> list[str]:
    return [choice["text"] for choice in httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_option(parser, "vllm_seed")
    args = parser.parse_args()
    console, rows = Console(), []
    prompts = [prompt_of(entry) for entry in load_battery(None)][:PROMPTS]
    for k in (0, 3):
        server = VllmServer(DEMO_DIR, k, eager=True)
        try:
            for concurrency in (1, 6):
                for n in (1, 2):
                    fields = {"model": "demo", "max_tokens": 16, "temperature": 0.8, "top_p": 0.95, "seed": 1234}
                    bodies = [fields | {"prompt": prompt, "n": n} for prompt in prompts] * 2
                    with ThreadPoolExecutor(concurrency) as pool:
                        out = list(pool.map(texts, [server.url] * len(bodies), bodies))
                    same = sum(out[i] == out[i + PROMPTS] for i in range(PROMPTS))
                    rows.append({"k": k, "concurrency": concurrency, "n": n, "reproduced": same, "prompts": PROMPTS})
                    console.print(f"k {k}, concurrency {concurrency}, n {n}: {same} of {PROMPTS} reproduced")
        finally:
            server.stop()
    write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
