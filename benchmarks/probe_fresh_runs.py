"""`probe`'s sweeps run afresh many times, as a user runs them: each sweep's false-positive rate on healthy servers
and each fault's power, at a nominal alpha the runs resolve, with their binomial intervals.

    python -m benchmarks.probe_fresh_runs [--runs 100] [--fault-runs 20] [--alpha 0.05] [--fault-alpha A ...]
        [--only SWEEP] [--resume] [--json FILE]

Every run is `specdoctor probe --SWEEP --alpha ALPHA --prompt-seed RUN` against one server started for its case:
its own prompts (the seed moves where each starts in the corpus), its own requests, decided by the probe's own
code and sized by it. So the runs' trajectories differ, where `probe_rates.py` resamples one pool of replies: a
deterministic server repeats itself exactly, and runs over the same prompts are one observation. The cases are
`probe_rates.py`'s (the context sweep at its three lengths), the prefix cache's, the concurrency sweep on a bf16
server too (whose numerics vary with the batch, so the levels' trajectories differ), and the sampling sweep at
--all's size (its draws unseeded: every run a fresh sample); `specdoctor serve`, PP 1, eager; and vLLM's CPU
build healthy (the peer suite's environment: fp32, MTP k 3, eager, prefix caching on, max_model_len 512), under
concurrency and with its prefix cache, whose scheduling, batching and kernels are the engine's own. Healthy servers run
at `--alpha`, which 100 runs resolve; faults at the probe's own alpha by default, the power a user gets. The JSON
is written after every run; `--resume` keeps its finished cases.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import contextmanager
from dataclasses import astuple
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from benchmarks.common import add_json_option, numeric_table, write_json
from benchmarks.probe_rates import CONCURRENCY, CONTEXT_LENGTHS, Case, interval
from specdoctor.probe.options import ALPHA, DEFAULT_SAMPLING_TOKENS
from specdoctor.report import NOT_RUN
from specdoctor.runtime.checkpoint.files import DEMO_MODELS
from tests.helpers.servers import SpecdoctorServer, probe
from tests.peer.vllm_server import VllmServer

VLLM_K = 3  # the demo's k on `serve`, so both engines draft alike
SWEEP_FLAGS = {
    "context": ("--context-sweep", "--context-lengths", ",".join(map(str, CONTEXT_LENGTHS))),
    "prefix-cache": ("--prefix-cache",),
    "concurrency": ("--concurrency", ",".join(map(str, CONCURRENCY))),
    "sampling": ("--sampling", str(DEFAULT_SAMPLING_TOKENS)),  # --all's: unseeded draws, a fresh sample every run
}
# probe_rates.py's cases and the prefix cache's (`planned` runs the faults first); the prefix cache's healthy server
# is the demo's, whose runs take two thirds of demo-dspark's.
CASES = (
    Case("concurrency", "demo", "stale-batch-rows"),
    Case("context", "demo", "drafter-max-position=1024"),
    Case("context", "demo-eagle3", None),  # no fault: a head trained on 128-token sequences, run past that
    Case("prefix-cache", "demo", "prefix-cache-drafter-kv"),
    Case("concurrency", "demo", None),
    Case("concurrency", "demo", None, "bfloat16"),  # levels' trajectories differ: 5 of 16 requests' counts did
    Case("context", "demo", None),
    Case("prefix-cache", "demo", None),
    Case("prefix-cache", "demo-dspark", "prefix-cache-drafter-kv"),
    Case("context", "demo-dspark", "drafter-rope-past=256"),
    Case("sampling", "demo", "sampling-params-ignored"),
    Case("sampling", "demo", "rejection-reuse-uniform"),
    Case("sampling", "demo", None),
    # the real engine: its own scheduler, batching and kernels (max_model_len 512, so no context sweep here)
    Case("concurrency", "demo", None, engine="vllm"),
    Case("concurrency", "demo", None, "bfloat16", engine="vllm"),
    Case("prefix-cache", "demo", None, engine="vllm"),
)
SAME_PROMPTS = ("concurrency", "prefix-cache")  # sweeps whose groups are the same prompts under two conditions


@contextmanager
def served(case: Case):
    """The case's server, up for its runs."""
    if case.engine == "vllm":
        server = VllmServer(DEMO_MODELS[case.model], VLLM_K, eager=True, dtype=case.dtype)
    else:
        server = SpecdoctorServer(*case.serve_args, model=case.model)
    try:
        yield server.url
    finally:
        server.stop()


def sweep_status(url: str, case: Case, seed: int, alpha: float, report: Path) -> tuple[str, bool]:
    """One fresh run's verdict on the case's sweep: passed, failed or NOT_RUN (the battery's own findings, which a
    fault may raise, are not the sweep's); and whether its groups' acceptance figures differed."""
    flags = (*SWEEP_FLAGS[case.sweep], "--alpha", str(alpha), "--prompt-seed", str(seed), "--json", str(report))
    result = probe(url, *flags, timeout=1800)
    if result.returncode == 2 or not report.exists():
        raise RuntimeError(f"probe {' '.join(flags)} could not run: {result.stdout[-2000:]}{result.stderr[-2000:]}")
    sweep = next(sweep for sweep in json.loads(report.read_text())["sweeps"] if sweep["name"] == case.sweep)
    figures = {json.dumps(point.get("metrics"), sort_keys=True) for point in sweep["points"]}
    return sweep["status"], len(figures) > 1


def row_of(case: Case, alpha: float, outcomes: list[tuple[str, bool]], started: float) -> dict:
    statuses = [status for status, _ in outcomes]
    runs, failed = len(statuses), statuses.count("failed")
    # where the groups are the same prompts, a run whose figures differed met the server's own variance
    differed = {"groups_differed": sum(differ for _, differ in outcomes)} if case.sweep in SAME_PROMPTS else {}
    return {
        "sweep": case.sweep,
        "model": case.model,
        "fault": case.fault,
        "dtype": case.dtype,
        "engine": case.engine,
        "alpha": alpha,
        "runs": runs,
        "failed": failed,
        "not_run": statuses.count(NOT_RUN),
        "rate": failed / runs,
        "interval_95": interval(failed, runs),
        "seconds_per_run": round((time.monotonic() - started) / runs, 1),
        **differed,
    }


def planned(args: argparse.Namespace) -> list[tuple[Case, float, int]]:
    """(case, alpha, runs): each fault at each --fault-alpha, then each healthy case at --alpha."""
    cases = [case for case in CASES if args.only in (None, case.sweep)]
    # demo-eagle3's context is a failure without a switch: its head run past its 128-token training
    faulty = [case for case in cases if case.fault or case.model == "demo-eagle3"]
    faults = [(case, alpha, args.fault_runs) for case in faulty for alpha in args.fault_alpha or [ALPHA]]
    healthy = [(case, args.alpha, args.runs) for case in cases if case not in faulty]
    return [(case, alpha, runs) for case, alpha, runs in faults + healthy if runs]  # --runs 0: the faults alone


def key(row: dict) -> tuple:
    """A row's case, alpha and runs, as `(*astuple(case), alpha, runs)` spells them."""
    case = Case(row["sweep"], row["model"], row["fault"], row.get("dtype", "float32"), row.get("engine", "specdoctor"))
    return *astuple(case), row["alpha"], row["runs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="runs of each healthy case")
    parser.add_argument("--fault-runs", type=int, default=20, help="runs of each faulty case")
    parser.add_argument("--alpha", type=float, default=0.05, help="the healthy cases' alpha, one the runs resolve")
    parser.add_argument(
        "--fault-alpha",
        type=float,
        action="append",
        help=f"the faulty cases' alpha, repeatable (default: the probe's own, {ALPHA:g}: the power a user gets)",
    )
    parser.add_argument("--only", choices=sorted(SWEEP_FLAGS), help="one sweep's cases")
    parser.add_argument("--resume", action="store_true", help="keep the JSON's finished cases, run the rest")
    add_json_option(parser, "probe_fresh_runs")
    args = parser.parse_args()
    kept = json.loads(args.json.read_text())["cases"] if args.resume and args.json.exists() else []
    finished = {key(row) for row in kept}
    todo = [(case, alpha, runs) for case, alpha, runs in planned(args) if (*astuple(case), alpha, runs) not in finished]
    redone = {(*astuple(case), alpha) for case, alpha, _ in todo}
    rows = [row for row in kept if key(row)[:-1] not in redone]  # a case cut short runs again, whole
    console = Console()
    with Progress(console=console) as progress, tempfile.TemporaryDirectory() as scratch:
        for case, alpha, runs in todo:
            label = f"{case.sweep} {case.engine} {case.model} {case.dtype} {case.fault or 'healthy'} at {alpha:g}"
            task = progress.add_task(label, total=runs)
            outcomes, started = [], time.monotonic()
            with served(case) as url:
                for seed in range(1, runs + 1):
                    outcomes.append(sweep_status(url, case, seed, alpha, Path(scratch) / "report.json"))
                    progress.advance(task)
                    # after every run: hours of runs in all, and one cut short keeps what it measured
                    write_json(args.json, {"cases": [*rows, row_of(case, alpha, outcomes, started)]})
            rows.append(row_of(case, alpha, outcomes, started))
    columns = ("sweep", "engine", "model", "dtype", "fault", "alpha", "runs", "failed", "95 % interval")
    table = numeric_table("fresh runs failing", columns)
    for row in rows:
        low, high = row["interval_95"]
        failed = f"{row['rate']:.1%}" + (f" ({row['not_run']} not run)" if row["not_run"] else "")
        fault = row["fault"] or "healthy"
        table.add_row(
            row["sweep"],
            row.get("engine", "specdoctor"),
            row["model"],
            row.get("dtype", "float32"),
            fault,
            f"{row['alpha']:g}",
            str(row["runs"]),
            failed,
            f"{low:.1%}-{high:.1%}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
