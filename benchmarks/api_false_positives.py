"""How often `probe --api` fails a healthy `specdoctor serve`: repeated runs against the same servers, with and without
the reference (the demo at k 0), every check's verdict counted.

    python -m benchmarks.api_false_positives [--runs 20] [--json FILE]

The demo at PP 2, MTP k 3, greedy checks sent 16 at a time (as traffic is); the servers stay up across runs, so the
batches each run's requests meet differ from run to run. The demo is served as a reasoning model's checkpoint
(tests/helpers/reasoning.py) with `--reasoning-parser hf`, so the schema after a reasoning is checked too.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.progress import track

from benchmarks.common import add_json_option, write_json
from specdoctor.probe.stats import rate_upper_bound
from tests.helpers.reasoning import save_thinking_demo
from tests.helpers.servers import SpecdoctorServer, probe


@functools.cache
def thinking_demo() -> Path:
    return save_thinking_demo(Path(tempfile.mkdtemp(prefix="specdoctor-reasoning-")) / "demo")


def api_server(*flags: str) -> SpecdoctorServer:
    """`serve` on the demo as a reasoning model's checkpoint (made once per process), its reasoning parser on."""
    return SpecdoctorServer(*flags, "--reasoning-parser", "hf", model=str(thinking_demo()))


def verdicts_and_evidence(url: str, reference: str | None) -> tuple[int, dict[str, tuple[str, str]]]:
    """`probe --api`'s exit code and each check's (verdict, evidence)."""
    args = ("--reference-url", reference) if reference else ()
    result = probe(url, "--api", *args, "--json", "-")
    api = next(sweep for sweep in json.loads(result.stdout)["sweeps"] if sweep["name"] == "api")
    return result.returncode, {point["label"]: (point["verdict"], point["evidence"]) for point in api["points"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    add_json_option(parser, "api_false_positives")
    args = parser.parse_args()
    console, results = Console(), {}
    healthy = api_server("--pp", "2", "--num-speculative-tokens", "3")
    off = api_server("--num-speculative-tokens", "0")
    try:
        for mode, reference in (("own output", None), ("reference", off.url)):
            counts, failed_runs = Counter(), 0
            for _ in track(range(args.runs), description=f"probe --api, {mode}"):
                code, found = verdicts_and_evidence(healthy.url, reference)
                failed_runs += code != 0
                counts.update(f"{label}: {verdict}" for label, (verdict, _) in found.items())
            bound = rate_upper_bound(failed_runs, args.runs, 0.05)
            results[mode] = {"runs": args.runs, "failed_runs": failed_runs, "rate_upper_95": bound, "verdicts": counts}
            console.print(f"{mode}: {failed_runs} of {args.runs} runs failed (95 % upper bound {bound:.1%})")
    finally:
        healthy.stop()
        off.stop()
    write_json(args.json, results)


if __name__ == "__main__":
    main()
