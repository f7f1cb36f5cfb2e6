"""Command-line entry point: parse, call one function, render, exit.

Exit codes: 0 healthy, 1 findings, 2 bad usage or unreadable input.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from specdoctor.checks.behaviour import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.errors import SpecdoctorError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_show_locals=False,
    help="Find and repair silent failures in speculative-decoding deployments.",
)
ModelOption = Annotated[str, typer.Option("--model", help="Checkpoint directory, or 'demo' for the built-in model.")]
PartitionOption = Annotated[
    str | None, typer.Option(help="Layers per rank, e.g. 14,12,12,7 (default: $VLLM_PP_LAYER_PARTITION or even).")
]
PolicyOption = Annotated[
    str, typer.Option(help="Drafter embedding loading: fixed, engine-legacy or alias-placeholder.")
]
HeadPolicyOption = Annotated[str, typer.Option(help="Drafter head loading: fixed, engine-legacy or unloaded.")]
FillOption = Annotated[str, typer.Option(help="What unloaded drafter memory holds: empty, zeros, nan or stale.")]
DeviceOption = Annotated[str, typer.Option(help="cpu (gloo) or cuda (NCCL).")]
DtypeOption = Annotated[str, typer.Option(help="float32, bfloat16 or float16.")]
TimeoutOption = Annotated[float, typer.Option(help="Seconds a rank waits on a peer before failing.")]
# The report-producing commands (check, probe) share these.
BatteryOption = Annotated[Path | None, typer.Option(help='JSON lines, each {"prompt": ...} (default: built-in 9).')]
MinLengthOption = Annotated[float, typer.Option(help="Fail below this mean acceptance length.")]
JsonReportOption = Annotated[str | None, typer.Option("--json", help="Write the JSON report to FILE, or - for stdout.")]
JunitOption = Annotated[Path | None, typer.Option(help="Write a JUnit XML report to FILE.")]


@app.callback()
def _root() -> None:
    """Keep subcommands explicit (`specdoctor inspect ...`) even while there is only one."""


@app.command()
def inspect(
    model: ModelOption,
    as_json: Annotated[bool, typer.Option("--json", help="Print only JSON on stdout.")] = False,
) -> None:
    """Describe a checkpoint from its headers alone: sizes, keys, where the drafter's tensors live."""
    from specdoctor.runtime.checkpoint import Checkpoint
    from specdoctor.summary import render_summary, summarize

    summary = summarize(Checkpoint(model))
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        render_summary(summary, Console())


@app.command()
def generate(
    model: ModelOption,
    prompt: Annotated[list[str] | None, typer.Option("--prompt", help="A prompt (repeat for a batch).")] = None,
    prompts_file: Annotated[Path | None, typer.Option(help='JSON lines, each {"prompt": ...}.')] = None,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel ranks (one process each).")] = 1,
    pp_partition: PartitionOption = None,
    num_speculative_tokens: Annotated[int, typer.Option(help="Draft tokens per step (0 = off, 1-8).")] = 0,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="0 = no top-k cut.")] = 0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
    drafter_policy: PolicyOption = "fixed",
    head_policy: HeadPolicyOption = "fixed",
    fill: FillOption = "empty",
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    timeout: TimeoutOption = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print only JSON on stdout.")] = False,
) -> None:
    """Generate text with the pipeline runtime; print it with the acceptance metrics."""
    from specdoctor.generate_command import GenerateOptions, render_generation, run_generate
    from specdoctor.runtime.sampling import SamplingParams
    from specdoctor.runtime.tokenizer import read_prompt_file

    prompts = list(prompt or []) + (read_prompt_file(prompts_file) if prompts_file else [])
    options = GenerateOptions(
        model,
        prompts,
        pp,
        pp_partition,
        num_speculative_tokens,
        max_tokens,
        SamplingParams(temperature, top_k, top_p, seed),
        drafter_policy,
        head_policy,
        fill,
        device,
        dtype,
        timeout,
    )
    report = run_generate(options, show_progress=not as_json)
    if report is None:  # a non-zero rank under torchrun: rank 0 prints
        return
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        render_generation(report, Console())


def _check(
    model: ModelOption,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel ranks to check (one process each).")] = 1,
    pp_partition: PartitionOption = None,
    num_speculative_tokens: Annotated[int, typer.Option(help="Draft tokens per step in the battery (1-8).")] = 3,
    drafter_policy: Annotated[
        str,
        typer.Option(
            help="How the drafter embedding is loaded: engine-legacy (an unpatched engine), fixed, alias-placeholder."
        ),
    ] = "engine-legacy",
    head_policy: HeadPolicyOption = "engine-legacy",
    fill: FillOption = "empty",
    repair: Annotated[
        bool, typer.Option("--repair", help="Repair the drafter from the checkpoint and re-check.")
    ] = False,
    battery: BatteryOption = None,
    min_acceptance_length: MinLengthOption = DEFAULT_MIN_ACCEPTANCE_LENGTH,
    max_tokens: Annotated[int, typer.Option(help="Tokens generated per battery prompt.")] = 32,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size whose vocab shard the repair checks.")] = 1,
    tp_rank: Annotated[int, typer.Option(help="Tensor-parallel rank whose vocab shard the repair checks.")] = 0,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    timeout: TimeoutOption = 60.0,
    json_out: JsonReportOption = None,
    junit_xml: JunitOption = None,
) -> None:
    from specdoctor.check_command import CheckOptions, run_check

    options = CheckOptions(
        model,
        pp,
        pp_partition,
        num_speculative_tokens,
        drafter_policy,
        head_policy,
        fill,
        repair,
        battery,
        min_acceptance_length,
        max_tokens,
        tp,
        tp_rank,
        device,
        dtype,
        timeout,
    )
    _emit(run_check(options, show_progress=json_out != "-"), json_out, junit_xml)


def _emit(report, json_out: str | None, junit_xml: Path | None) -> None:
    """Human tables on stdout (or only JSON with --json -), optional JSON/JUnit files; exit with the verdict."""
    from specdoctor.report import render_human, to_json, to_junit

    if json_out == "-":
        sys.stdout.write(to_json(report))
    else:
        render_human(report, Console())
        if json_out:
            _write(Path(json_out), to_json(report))
    if junit_xml:
        _write(junit_xml, to_junit(report))
    raise typer.Exit(report.exit_code)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise SpecdoctorError(f"{path}: cannot write report ({err.strerror})") from None


app.command(
    "check",
    help="Detect a broken drafter under pipeline parallelism; with --repair, fix it from the checkpoint and prove it.",
)(_check)


@app.command("repair")
def repair_command(
    model: ModelOption,
    pp: Annotated[int, typer.Option("--pp")] = 1,
    pp_partition: PartitionOption = None,
    num_speculative_tokens: Annotated[int, typer.Option()] = 3,
    json_out: JsonReportOption = None,
    junit_xml: JunitOption = None,
) -> None:
    """Same as `specdoctor check --repair` with the default engine-legacy loading."""
    _check(model, pp, pp_partition, num_speculative_tokens, repair=True, json_out=json_out, junit_xml=junit_xml)


@app.command()
def serve(
    model: ModelOption,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel ranks (one process each).")] = 1,
    pp_partition: PartitionOption = None,
    num_speculative_tokens: Annotated[int, typer.Option(help="Draft tokens per step (0 = off).")] = 3,
    host: Annotated[str, typer.Option(help="Address to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    api_key: Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on /v1.")] = None,
    allow_unhealthy: Annotated[
        bool, typer.Option("--allow-unhealthy", help="Serve even with error findings, without repairing.")
    ] = False,
    drafter_policy: PolicyOption = "fixed",
    head_policy: HeadPolicyOption = "fixed",
    fill: FillOption = "empty",
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    timeout: TimeoutOption = 60.0,
) -> None:
    """Serve an OpenAI-compatible API with the drafter fixes applied and vLLM-style metrics."""
    from specdoctor.serve_command import ServeOptions, run_serve

    run_serve(
        ServeOptions(
            model,
            pp,
            pp_partition,
            num_speculative_tokens,
            host,
            port,
            api_key,
            allow_unhealthy,
            drafter_policy,
            head_policy,
            fill,
            device,
            dtype,
            timeout,
        )
    )


@app.command()
def probe(
    url: Annotated[str, typer.Option("--url", help="Base URL of the deployment, e.g. http://127.0.0.1:8000")],
    api_key: Annotated[str | None, typer.Option(help="Bearer token for the server.")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model to probe (default: the first served).")] = None,
    battery: BatteryOption = None,
    min_acceptance_length: MinLengthOption = DEFAULT_MIN_ACCEPTANCE_LENGTH,
    max_tokens: Annotated[int, typer.Option(help="Tokens per battery prompt.")] = 32,
    request_timeout: Annotated[float, typer.Option(help="Seconds per request.")] = 60.0,
    timeout: Annotated[float, typer.Option(help="Seconds for the whole probe.")] = 600.0,
    json_out: JsonReportOption = None,
    junit_xml: JunitOption = None,
) -> None:
    """Check a live deployment's speculative decoding over HTTP; exit 0 healthy, 1 findings, 2 unusable input."""
    from specdoctor.probe_command import ProbeOptions, run_probe

    report = run_probe(
        ProbeOptions(url, api_key, model, battery, min_acceptance_length, max_tokens, request_timeout, timeout)
    )
    _emit(report, json_out, junit_xml)


@app.command()
def bench(
    model: ModelOption,
    pp: Annotated[list[int] | None, typer.Option("--pp", help="Pipeline sizes to compare (repeat; default 1).")] = None,
    num_speculative_tokens: Annotated[
        list[int] | None, typer.Option(help="k values to compare with plain decoding (repeat; default 1-5).")
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 64,
    batch_size: Annotated[int, typer.Option(help="Prompts decoded together (1 = latency).")] = 1,
    battery: BatteryOption = None,
    drafter_policy: PolicyOption = "fixed",
    head_policy: HeadPolicyOption = "fixed",
    fill: FillOption = "empty",
    device: DeviceOption = "cpu",
    dtype: DtypeOption = "float32",
    timeout: TimeoutOption = 60.0,
    json_out: Annotated[
        str | None, typer.Option("--json", help="Write the JSON results to FILE, or - for stdout.")
    ] = None,
) -> None:
    """Measure speculative against plain decoding: tokens/s, acceptance and each step's time split; exit 1 if
    speculative output ever differs from plain output."""
    from specdoctor.bench_command import BenchOptions, bench_table, run_bench

    options = BenchOptions(
        model,
        pp or [1],
        num_speculative_tokens or [1, 2, 3, 4, 5],
        max_tokens,
        batch_size,
        battery,
        drafter_policy,
        head_policy,
        fill,
        device,
        dtype,
        timeout,
    )
    report = run_bench(options, show_progress=json_out != "-")
    text = json.dumps(report, indent=2) + "\n"
    if json_out == "-":
        sys.stdout.write(text)
    else:
        Console().print(bench_table(report))
        if json_out:
            _write(Path(json_out), text)
    raise typer.Exit(0 if all(row["lossless"] for row in report["rows"]) else 1)


def main() -> None:
    try:
        app()
    except SpecdoctorError as err:
        Console(stderr=True).print(f"specdoctor: error: {err}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
