"""The sampling sweep's two-sample test against a reference (speculation off): its false-positive rate on a healthy
server and its power on `sampling-params-ignored`, at each default setting, with their binomial intervals.

    python -m benchmarks.sampling_rates [--runs 1000] [--pool 64] [--json FILE]

Each server (`specdoctor serve`, the demo, fp32, eager: PP 2 at k 3, and the reference at k 0, PP 1) samples a
pool of requests at each setting, as the sweep sends them (128 tokens, 4 in flight, unseeded: every request is a
fresh draw). A run takes as many requests from each pool as the default sweep size sends (DEFAULT_SAMPLING_TOKENS)
and is decided by the sweep's own test (`two_sample_findings`) at the sweep's alpha, split over the settings as the
sweep splits it, and at a nominal 5 %. Runs resample the pools, so they overlap: read each rate as the test's on
these pools, with Wilson's 95 % interval.
"""

from __future__ import annotations

import argparse
import random

from rich.console import Console
from rich.progress import track

from benchmarks.common import add_json_option, machine, numeric_table, write_json
from benchmarks.probe_rates import interval
from specdoctor.battery import load_battery, prompt_of
from specdoctor.probe.client import Probe
from specdoctor.probe.options import ALPHA, DEFAULT_SAMPLING_TOKENS, ProbeOptions
from specdoctor.probe.output_sweeps import SAMPLING_TOKENS_PER_REQUEST, calibration, two_sample_findings
from specdoctor.probe.sampling_settings import DEFAULT_SETTINGS, parse_settings
from tests.helpers.servers import SpecdoctorServer

SETTINGS = parse_settings(DEFAULT_SETTINGS)
SERVERS = {
    "healthy": ("--pp", "2", "--num-speculative-tokens", "3"),
    "sampling-params-ignored": ("--pp", "2", "--num-speculative-tokens", "3", "--fault", "sampling-params-ignored"),
    "reference": ("--num-speculative-tokens", "0"),
}


def pools(size: int, console: Console) -> dict[str, dict[str, list]]:
    """Per server and setting, each sampled request's (tokens drawn at rank 1, tokens with a reported top)."""
    prompts = [prompt_of(entry) for entry in load_battery(None)]
    found = {}
    for name, flags in track(SERVERS.items(), description=f"{size} requests a setting, each server", console=console):
        server = SpecdoctorServer(*flags, *(("--allow-unhealthy",) if "--fault" in flags else ()))
        try:
            probe = Probe(ProbeOptions(server.url, timeout=3600.0))
            served = probe.served_model()
            found[name] = {}
            for setting in SETTINGS:
                result = calibration(probe, served, size * SAMPLING_TOKENS_PER_REQUEST, prompts, setting)
                found[name][setting.label] = result["top_draws"]
        finally:
            server.stop()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--pool", type=int, default=64, help="requests each server samples at each setting")
    add_json_option(parser, "sampling_rates")
    args = parser.parse_args()
    console, rng = Console(), random.Random(0)
    per_run = -(-DEFAULT_SAMPLING_TOKENS // SAMPLING_TOKENS_PER_REQUEST)
    sampled = pools(args.pool, console)
    alphas = {"sweep": ALPHA / len(SETTINGS), "nominal": 0.05}
    rows, table = [], numeric_table("two-sample test, runs failing", ("server", "setting", "alpha", "rate", "95 %"))
    for name in ("healthy", "sampling-params-ignored"):
        for setting in SETTINGS:
            ours, theirs = sampled[name][setting.label], sampled["reference"][setting.label]
            failures = dict.fromkeys(alphas, 0)
            for _ in track(range(args.runs), description=f"{name} at {setting.label}", console=console):
                run_ours, run_theirs = rng.sample(ours, per_run), rng.sample(theirs, per_run)
                result = {"top_draws": run_ours}
                two_sample_findings("reference", setting, result, {"top_draws": run_theirs}, 0.0)
                for label, alpha in alphas.items():
                    failures[label] += result["two_sample_p_value"] < alpha
            for label, alpha in alphas.items():
                low, high = interval(failures[label], args.runs)
                rate = failures[label] / args.runs
                rows.append(
                    {
                        "server": name,
                        "setting": setting.label,
                        "alpha": alpha,
                        "runs": args.runs,
                        "failing": failures[label],
                        "rate": rate,
                        "interval": [low, high],
                    }
                )
                table.add_row(name, setting.label, f"{alpha:.2g}", f"{rate:.1%}", f"{low:.1%}-{high:.1%}")
    console.print(table)
    shares = {
        name: {label: sum(x for x, _ in units) / sum(n for _, n in units) for label, units in by_setting.items()}
        for name, by_setting in sampled.items()
    }
    write_json(
        args.json,
        {"machine": machine(), "pool": args.pool, "requests_a_run": per_run, "rates": rows, "rank_1_share": shares},
    )


if __name__ == "__main__":
    main()
