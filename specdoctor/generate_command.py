"""`specdoctor generate`: run prompts through the pipeline runtime and report acceptance."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.decode import GenerateRequest, GenerateResult
from specdoctor.runtime.drafter_loading import DrafterPolicy
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.metrics import SpecMetrics
from specdoctor.runtime.sampling import SamplingParams
from specdoctor.runtime.tokenizer import TextCodec
from specdoctor.runtime.worker import EngineSpec, run_under_torchrun


@dataclass(frozen=True)
class GenerateOptions:
    model: str
    prompts: list[str]
    pp: int
    pp_partition: str | None
    num_speculative_tokens: int
    max_tokens: int
    sampling: SamplingParams
    drafter_policy: str
    head_policy: str
    fill: str
    device: str
    dtype: str
    timeout_s: float


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_generate(options: GenerateOptions, show_progress: bool) -> dict | None:
    """Generate for every prompt; returns the report (None on the non-zero ranks under torchrun)."""
    if not options.prompts:
        raise SpecdoctorError("give at least one --prompt or --prompts-file")
    if launched_by_torchrun():
        from specdoctor.runtime.checkpoint import Checkpoint

        checkpoint = Checkpoint(options.model)
        codec = TextCodec(checkpoint.path, checkpoint.config.eos_token_ids)
        policy = DrafterPolicy(options.drafter_policy, options.head_policy, options.fill)
        spec = EngineSpec(
            str(checkpoint.path),
            options.pp,
            options.pp_partition,
            policy,
            options.dtype,
            options.device,
            options.timeout_s,
        )
        request = GenerateRequest(
            [codec.encode(p) for p in options.prompts],
            options.max_tokens,
            options.sampling,
            options.num_speculative_tokens,
            codec.eos_token_ids,
        )
        result = run_under_torchrun(spec, request)
        return None if result is None else build_report(options, codec, result)
    with Engine.from_options(
        options, num_speculative_tokens=options.num_speculative_tokens, show_progress=show_progress
    ) as engine:
        codec = TextCodec(engine.checkpoint.path, engine.config.eos_token_ids)
        result = engine.generate([codec.encode(p) for p in options.prompts], options.max_tokens, options.sampling)
    return build_report(options, codec, result)


def build_report(options: GenerateOptions, codec: TextCodec, result: GenerateResult) -> dict:
    return {
        "model": options.model,
        "pp": options.pp,
        "num_speculative_tokens": options.num_speculative_tokens,
        "drafter_policy": options.drafter_policy,
        "outputs": [
            {"prompt": prompt, "completion": codec.decode(tokens), "tokens": tokens, "finish_reason": reason}
            for prompt, tokens, reason in zip(options.prompts, result.tokens, result.finish_reasons, strict=True)
        ],
        "metrics": result.metrics.to_dict(),
    }


def metrics_table(metrics: SpecMetrics | dict, title: str) -> Table:
    data = metrics.to_dict() if isinstance(metrics, SpecMetrics) else metrics
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
