"""`specdoctor bench`: its flags, the table of what the workflow measured (specdoctor/workflow/bench.py) and the exit
code: 1 when speculative output differs from plain output beyond a rounding tie.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from specdoctor.commands.options import BatteryOption, JsonReportOption, runtime_command
from specdoctor.commands.output import emit_json_or_table
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.workflow.bench import PHASES, BenchOptions, run_bench

# Speculative against plain decoding at each PP size and k; k = 0 is always measured.
BENCH_SWEEPS = dict(pp=[1], num_speculative_tokens=[1, 2, 3, 4, 5])

MaxTokensOption = Annotated[int, typer.Option(help="Tokens per prompt.")]
BatchSizeOption = Annotated[int, typer.Option(help="Prompts decoded together (1 = latency).")]


@runtime_command(repeat=("pp", "num_speculative_tokens"), compile=True, **BENCH_SWEEPS)
def bench(
    runtime: RuntimeOptions,
    sweeps: dict,
    max_tokens: MaxTokensOption = 64,
    batch_size: BatchSizeOption = 1,
    battery: BatteryOption = None,
    json_out: JsonReportOption = None,
) -> None:
    """Measure speculative against plain decoding: tokens/s, acceptance and each step's time split; exit 1 if
    speculative output differs from plain output other than at a rounding tie. --pp and --num-speculative-tokens
    may be repeated."""
    options = BenchOptions(runtime, sweeps["pp"], sweeps["num_speculative_tokens"], max_tokens, batch_size, battery)
    report = run_bench(options, show_progress=json_out != "-")
    emit_json_or_table(
        json.dumps(report, indent=2) + "\n", json_out, lambda console: console.print(bench_table(report))
    )
    raise typer.Exit(0 if all(lossless_label(row) != "NO" for row in report["rows"]) else 1)


def lossless_label(row: dict) -> str:
    """yes: the same tokens as plain decoding; ties: every difference begins where the target's two best tokens are
    within rounding (a verify pass and a one-token step round a near tie differently, as `check` reports it);
    NO: a difference beyond rounding."""
    from specdoctor.checks.behaviour import rounding_ties_only

    if row["lossless"]:
        return "yes"
    return "ties" if rounding_ties_only(row["divergences"]) else "NO"


def bench_table(report: dict) -> Table:
    settings = report["settings"]
    table = Table(
        title=f"{report['prompts']} prompts x {settings['max_tokens']} tokens, batch {settings['batch_size']}, "
        f"TP {settings.get('tp', 1)}, {'compiled' if settings.get('compiled') else 'eager'}, greedy"
    )
    columns = ["PP", "k", "tok/s", "speed-up", "accept len", "bound", "÷ bound", "ms/step", *PHASES, "lossless"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in report["rows"]:
        split = row["last_rank_ms_per_step"]
        table.add_row(
            str(row["pp"]),
            str(row["k"]),
            f"{row['tokens_per_s']:.1f}",
            f"{row['speedup']:.2f}x",
            f"{row['mean_acceptance_length']:.2f}",
            f"{row['speedup_bound']:.2f}x" if row["speedup_bound"] else "-",
            f"{row['speedup_of_bound']:.2f}" if row["speedup_of_bound"] else "-",
            f"{row['step_ms']:.2f}",
            *(f"{split[phase]:.2f}" for phase in PHASES),
            lossless_label(row),
        )
    table.caption = (
        "target/draft/transfer/host: ms per decode step on the last rank (transfer includes waiting for peers); "
        "bound: acceptance length × plain pass ÷ (verify pass + draft), the passes summed over the stages"
        + (
            "; lossless ties: output differs only where the target's two best tokens are within rounding"
            if any(lossless_label(row) == "ties" for row in report["rows"])
            else ""
        )
    )
    return table
