"""`specdoctor probe`: a live deployment's speculative decoding, judged over HTTP."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.commands.options import BatteryOption, HtmlOption, JsonReportOption, JunitOption, MinLengthOption
from specdoctor.commands.output import emit_report
from specdoctor.errors import SpecdoctorError
from specdoctor.probe.corpus import STARTS
from specdoctor.probe.options import ALPHA, DEFAULT_CONCURRENCY, DEFAULT_SAMPLING_TOKENS, ProbeOptions, SweepOptions
from specdoctor.probe.pace import SAFETY
from specdoctor.probe.sampling_settings import DEFAULT_SETTINGS, parse_settings
from specdoctor.report import ProbeReport, Sweep, acceptance_row, findings_table, render_verdict

UrlOption = Annotated[str, typer.Option("--url", help="Base URL of the deployment, e.g. http://127.0.0.1:8000")]
ApiKeyOption = Annotated[str | None, typer.Option(help="Bearer token for the server.")]
ServedModelOption = Annotated[str | None, typer.Option("--model", help="Served model to probe (default: the first).")]
MaxTokensOption = Annotated[int, typer.Option(help="Tokens per battery prompt.")]
RequestTimeoutOption = Annotated[
    float,
    typer.Option(
        help=f"Seconds a request gets at least; more where the server's measured pace needs it ({SAFETY:g}x its "
        "slowest so far), up to what is left of --timeout."
    ),
]
TimeoutOption = Annotated[float, typer.Option(help="Seconds for the whole probe: past it, sweeps are not run.")]
ContextSweepFlag = Annotated[
    bool, typer.Option("--context-sweep", help="Acceptance against prompt length, up to the served max_model_len.")
]
ContextLengthsOption = Annotated[
    str | None, typer.Option(help="The context sweep's prompt lengths in tokens, e.g. 512,1024,4096.")
]
MaxContextOption = Annotated[
    int | None, typer.Option(min=1, help="The context sweep's top, where /v1/models has none.")
]
PrefixCacheFlag = Annotated[
    bool, typer.Option("--prefix-cache", help="Acceptance of the same long prompts cold, then warm (prefix-cached).")
]
SweepPromptsOption = Annotated[
    int | None,
    typer.Option(
        min=2,
        max=STARTS,
        help="Prompts per context-length bucket and per prefix-cache group (default: as many as each sweep's power "
        "needs).",
    ),
]
ConcurrencyOption = Annotated[
    str | None, typer.Option(help="Acceptance at each number of requests in flight, e.g. 1,4,16.")
]
SamplingOption = Annotated[
    int,
    typer.Option(
        min=0, help="Sample this many tokens at each sampling setting: are they the target's distribution there?"
    ),
]
SamplingSettingsOption = Annotated[
    str,
    typer.Option(
        help="The sampling sweep's settings, TEMPERATURE[:TOP_P[:TOP_K]] comma-separated: temperature 1 and the "
        "chat defaults by default."
    ),
]
ReferenceUrlOption = Annotated[
    str | None, typer.Option(help="The same model served with speculation off: greedy output must be identical.")
]
ApiFlag = Annotated[
    bool,
    typer.Option(
        "--api",
        help="The request API under speculation: stop strings and ids, max_tokens mid-run, log-probabilities, "
        "logit bias, penalties, seeds; against --reference-url where given.",
    ),
]
AlphaOption = Annotated[
    float,
    typer.Option(
        min=1e-9,
        max=0.5,
        help="Each sweep's false-positive rate: the chance that a healthy server fails it (its tests split it).",
    ),
]
PromptSeedOption = Annotated[
    int,
    typer.Option(
        min=0,
        help="Start the sweeps' prompts elsewhere in the corpus (0: where they always start): to see a verdict on "
        "other prompts.",
    ),
]
AllFlag = Annotated[
    bool,
    typer.Option(
        "--all",
        help=f"Every sweep: context, prefix cache, concurrency {','.join(map(str, DEFAULT_CONCURRENCY))}, sampling "
        f"{DEFAULT_SAMPLING_TOKENS} tokens at each setting, the request API, and the reference comparison where "
        "--reference-url is given.",
    ),
]


def concurrency_levels(text: str | None) -> tuple[int, ...]:
    """--concurrency's levels: two at least, the first the reference the others are compared with."""
    levels = tuple(sorted(set(integers(text, "--concurrency"))))
    if len(levels) == 1:
        raise SpecdoctorError(f"--concurrency {text!r}: give two levels or more, e.g. 1,{max(4, levels[0] * 4)}")
    return levels


def integers(text: str | None, flag: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers."""
    if text is None:
        return ()
    try:
        values = tuple(int(item) for item in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise SpecdoctorError(f"{flag} {text!r} is not a list of positive integers such as 1,4,16")
    return values


def probe(
    url: UrlOption,
    api_key: ApiKeyOption = None,
    model: ServedModelOption = None,
    battery: BatteryOption = None,
    min_acceptance_length: MinLengthOption = DEFAULT_MIN_ACCEPTANCE_LENGTH,
    max_tokens: MaxTokensOption = 32,
    request_timeout: RequestTimeoutOption = 60.0,
    timeout: TimeoutOption = 600.0,
    context_sweep: ContextSweepFlag = False,
    context_lengths: ContextLengthsOption = None,
    max_context: MaxContextOption = None,
    sweep_prompts: SweepPromptsOption = None,
    prefix_cache: PrefixCacheFlag = False,
    concurrency: ConcurrencyOption = None,
    sampling: SamplingOption = 0,
    sampling_settings: SamplingSettingsOption = DEFAULT_SETTINGS,
    reference_url: ReferenceUrlOption = None,
    api: ApiFlag = False,
    alpha: AlphaOption = ALPHA,
    prompt_seed: PromptSeedOption = 0,
    run_all: AllFlag = False,
    json_out: JsonReportOption = None,
    junit_xml: JunitOption = None,
    html: HtmlOption = None,
) -> None:
    """Check a live deployment's speculative decoding over HTTP; exit 0 healthy, 1 findings, 2 unusable input."""
    from specdoctor.probe.run import run_probe

    sweeps = SweepOptions(
        context=context_sweep or run_all,
        context_lengths=integers(context_lengths, "--context-lengths"),
        max_context=max_context,
        sweep_prompts=sweep_prompts,
        prefix_cache=prefix_cache or run_all,
        concurrency=concurrency_levels(concurrency) or (DEFAULT_CONCURRENCY if run_all else ()),
        sampling_tokens=sampling or (DEFAULT_SAMPLING_TOKENS if run_all else 0),
        sampling_settings=parse_settings(sampling_settings),
        reference_url=reference_url,
        api=api or run_all,
        every_sweep=run_all,
        alpha=alpha,
        prompt_seed=prompt_seed,
    )
    options = ProbeOptions(
        url, api_key, model, battery, min_acceptance_length, max_tokens, request_timeout, timeout, sweeps
    )
    emit_report(run_probe(options), json_out, junit_xml, render_probe, html)


def render_probe(report: ProbeReport, console: Console) -> None:
    console.print(findings_table(f"Probe · {report.url} · {report.served_model}", report.all_findings()))
    if report.metrics:
        table = Table(title=f"Acceptance from {report.source} figures (mean acceptance length counts the bonus token)")
        for column in ("mean acceptance length", "acceptance rate", "per-position rates", "battery"):
            table.add_column(column)
        table.add_row(*acceptance_row(report.metrics), report.battery)
        console.print(table)
    for sweep in report.sweeps:
        console.print(sweep_table(sweep))
    render_verdict(report, console)


def sweep_table(sweep: Sweep) -> Table:
    """A sweep's points, with a bar per point: mean acceptance length for the acceptance sweeps, observed
    against expected counts per rank bin for the sampling sweep; the API sweep's checks as rows."""
    table = Table(title=f"{sweep.name} sweep · {sweep.status} · {sweep.summary}", title_justify="left")
    if sweep.points and all("verdict" in point for point in sweep.points):  # the API sweep's checks
        for column in ("check", "requests", "verdict", "evidence"):
            table.add_column(column)
        for point in sweep.points:
            table.add_row(point["label"], str(point["requests"]), point["verdict"], point["evidence"])
        return table
    table.add_column("point")
    table.add_column("figures")
    table.add_column("", no_wrap=True)
    for point in sweep.points:
        table.add_row(str(point["label"]), *point_cells(point))
    return table


def point_cells(point: dict) -> tuple[str, str]:
    metrics = point.get("metrics") or {}
    mean = metrics.get("mean_acceptance_length")
    if mean is not None:
        rates = " ".join(f"{r:.0%}" for r in metrics.get("per_position_acceptance_rate") or [])
        return f"{mean:.2f} · {rates}", "[cyan]" + "█" * round(mean * 8) + "[/cyan]"
    if "observed" in point:
        pairs = " ".join(f"{o}/{e:.0f}" for o, e in zip(point["observed"], point["expected"], strict=True))
        return f"observed/expected by rank: {pairs}", f"p = {point['p_value']:.2g}"
    divergence = point.get("divergence")
    return ("identical", "") if divergence is None else (f"differs at token {divergence['index']}", "")
