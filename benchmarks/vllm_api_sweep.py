"""`probe --api` on vLLM's CPU build: MTP (k 3) against vLLM without speculation as the reference, `specdoctor serve`
at k 0 against the same reference, `specdoctor serve` at k 3 against vLLM's MTP at k 3, and each vLLM alone (its own
plain output).

    python -m benchmarks.vllm_api_sweep [--json FILE]

The demo, fp32, eager. Each row: a check's verdict and evidence, per pairing.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from benchmarks.common import add_json_option, write_json
from specdoctor.runtime.checkpoint.files import DEMO_DIR
from tests.helpers.servers import SpecdoctorServer, probe
from tests.peer.vllm_server import VllmServer


def api_points(url: str, reference: str | None) -> list[dict]:
    args = ("--reference-url", reference) if reference else ()
    report = json.loads(probe(url, "--api", *args, "--json", "-").stdout)
    return next(sweep for sweep in report["sweeps"] if sweep["name"] == "api")["points"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_option(parser, "vllm_api_sweep")
    args = parser.parse_args()
    console, results = Console(), {}
    mtp, plain = VllmServer(DEMO_DIR, 3, eager=True), VllmServer(DEMO_DIR, 0, eager=True)
    ours = SpecdoctorServer("--num-speculative-tokens", "0")
    ours_mtp = SpecdoctorServer("--num-speculative-tokens", "3")
    try:
        pairings = {
            "vLLM MTP k 3 against vLLM k 0": (mtp.url, plain.url),
            "specdoctor serve k 0 against vLLM k 0": (ours.url, plain.url),
            "specdoctor serve k 3 against vLLM MTP k 3": (ours_mtp.url, mtp.url),
            "vLLM MTP k 3 alone": (mtp.url, None),
            "vLLM k 0 alone": (plain.url, None),
        }
        for name, (url, reference) in pairings.items():
            results[name] = api_points(url, reference)
            console.print(f"[bold]{name}[/bold]")
            for point in results[name]:
                console.print(f"  {point['label']}: {point['verdict']} ({point['evidence'][:160]})")
    finally:
        for server in (mtp, plain, ours, ours_mtp):
            server.stop()
    write_json(args.json, {"pairings": results})


if __name__ == "__main__":
    main()
