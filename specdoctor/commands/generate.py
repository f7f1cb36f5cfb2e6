"""`specdoctor generate`: its flags, and the rendering of what the workflow generated (specdoctor/workflow/generate.py)
with the acceptance metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from specdoctor.commands.options import JsonReportOption, runtime_command
from specdoctor.commands.output import emit_json_or_table
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.workflow.generate import run_generate

PromptOption = Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeat for a batch).")]
PromptsFileOption = Annotated[Path | None, typer.Option(help='JSON lines, each {"prompt": ...}.')]
MaxTokensOption = Annotated[int, typer.Option(help="Tokens to generate per prompt.")]
TemperatureOption = Annotated[float, typer.Option(help="0 = greedy.")]
TopKOption = Annotated[int, typer.Option(help="0 = no top-k cut.")]
TopPOption = Annotated[float, typer.Option()]
SeedOption = Annotated[int | None, typer.Option(help="Seed for sampling.")]


@runtime_command()
def generate(
    runtime: RuntimeOptions,
    prompt: PromptOption = None,
    prompts_file: PromptsFileOption = None,
    max_tokens: MaxTokensOption = 64,
    temperature: TemperatureOption = 0.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
    seed: SeedOption = None,
    json_out: JsonReportOption = None,
) -> None:
    """Generate text with the pipeline runtime; print it with the acceptance metrics."""
    from specdoctor.runtime.checkpoint.tokenizer import read_prompt_file
    from specdoctor.runtime.sampling import SamplingParams

    prompts = list(prompt or []) + (read_prompt_file(prompts_file) if prompts_file else [])
    sampling = SamplingParams(temperature, top_k, top_p, seed)
    report = run_generate(runtime, prompts, max_tokens, sampling, show_progress=json_out != "-")
    if report is None:  # a non-zero rank under torchrun: rank 0 prints
        return
    emit_json_or_table(
        json.dumps(report, indent=2) + "\n", json_out, lambda console: render_generation(report, console)
    )


def metrics_table(data: dict, title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("drafts", str(data["num_drafts"]))
    table.add_row("draft tokens", str(data["num_draft_tokens"]))
    table.add_row("accepted tokens", str(data["num_accepted_tokens"]))
    table.add_row("acceptance rate", f"{data['acceptance_rate']:.1%}")
    table.add_row("mean acceptance length (incl. bonus token)", f"{data['mean_acceptance_length']:.2f}")
    rates = data["per_position_acceptance_rate"]
    table.add_row("per-position acceptance", " ".join(f"{r:.0%}" for r in rates) or "-")
    return table


def render_generation(report: dict, console: Console) -> None:
    for output in report["outputs"]:
        console.rule(f"[bold]{output['finish_reason']}[/bold] · {len(output['tokens'])} tokens")
        console.print(output["prompt"], style="dim", end="", markup=False, highlight=False)
        console.print(output["completion"], markup=False, highlight=False)
    if report["num_speculative_tokens"]:
        k, policy = report["num_speculative_tokens"], report["drafter_policy"]
        title = f"Speculative decoding · PP {report['pp']} · k {k} · {policy}"
        console.print(metrics_table(report["metrics"], title))
    else:
        console.print("(speculative decoding off: --num-speculative-tokens 0)")
