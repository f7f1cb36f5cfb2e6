"""How long `specdoctor serve` takes to answer /health: compiled from a cold compile cache, compiled from a warm
one, and eager (`--no-compile`), one server at a time.

    python -m benchmarks.serve_startup [--model demo] [--warm-rounds 3] [--json runs/serve_startup.json]

Each start is timed from launching the process to its first /health 200, which comes after the ranks have
loaded, the drafter was checked and, compiled, every batch shape a request can meet was compiled. The cold start
uses an empty cache directory (TORCHINDUCTOR_CACHE_DIR); the warm starts reuse it. Median of the warm and eager rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console

from benchmarks.common import machine, numeric_table, write_json
from tests.helpers.servers import SpecdoctorServer

COLD_START_TIMEOUT_S = 1800  # minutes of Inductor on 2 cores


def start_seconds(model: str, cache: Path, *flags: str) -> float:
    began = time.perf_counter()
    server = SpecdoctorServer(  # adaptive speculation, serve's default (not the test helper's): its warm-up
        *flags,
        "--adaptive-speculation",
        model=model,
        start_timeout_s=COLD_START_TIMEOUT_S,
        env={"TORCHINDUCTOR_CACHE_DIR": str(cache)},
    )
    seconds = time.perf_counter() - began
    server.stop()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--warm-rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("runs/serve_startup.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specdoctor-cache-") as cache:
        cold = start_seconds(args.model, Path(cache), "--compile")
        warm = [start_seconds(args.model, Path(cache), "--compile") for _ in range(args.warm_rounds)]
        eager = [start_seconds(args.model, Path(cache), "--no-compile") for _ in range(args.warm_rounds)]
    rows = [
        {"start": "compiled, cold cache", "seconds": cold, "rounds": [cold]},
        {"start": "compiled, warm cache", "seconds": statistics.median(warm), "rounds": warm},
        {"start": "eager (--no-compile)", "seconds": statistics.median(eager), "rounds": eager},
    ]
    write_json(args.json, {"model": args.model, "rows": rows})
    table = numeric_table(
        f"specdoctor serve --model {args.model}: launch to /health 200 ({machine()})", ("start", "seconds", "rounds")
    )
    for row in rows:
        table.add_row(row["start"], f"{row['seconds']:.1f}", " ".join(f"{s:.1f}" for s in row["rounds"]))
    Console().print(table)


if __name__ == "__main__":
    main()
