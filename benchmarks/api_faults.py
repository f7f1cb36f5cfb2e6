"""What `probe --api` reports on `specdoctor serve` with each of the API sweep's output faults, with and without the
reference (the demo at k 0): each check's verdict and evidence.

    python -m benchmarks.api_faults [--json FILE]

The demo at PP 2, MTP k 3, one server per fault, served as a reasoning model's checkpoint with its reasoning parser
on (benchmarks/api_false_positives.py).
"""

from __future__ import annotations

import argparse

from rich.console import Console

from benchmarks.api_false_positives import api_server, verdicts_and_evidence
from benchmarks.common import add_json_option, write_json

FAULTS = (
    "penalties-per-step",
    "logprobs-of-draft",
    "stop-in-draft-missed",
    "eos-leak-past-max-tokens",
    "grammar-no-rollback",
    "reasoning-end-unmasked",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_option(parser, "api_faults")
    args = parser.parse_args()
    console, results = Console(), {}
    off = api_server("--num-speculative-tokens", "0")
    try:
        for fault in FAULTS:
            flags = ("--pp", "2", "--num-speculative-tokens", "3", "--fault", fault, "--allow-unhealthy")
            server = api_server(*flags)
            try:
                for mode, reference in (("own output", None), ("reference", off.url)):
                    code, points = verdicts_and_evidence(server.url, reference)
                    results[f"{fault}, {mode}"] = {"exit": code, "checks": points}
                    failed = {label: evidence for label, (verdict, evidence) in points.items() if verdict == "failed"}
                    console.print(f"[bold]{fault}, {mode}[/bold]: exit {code}")
                    for label, evidence in failed.items():
                        console.print(f"  {label}: {evidence[:150]}")
            finally:
                server.stop()
    finally:
        off.stop()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
