"""`specdoctor serve`: its flags; the start-up and serving are the workflow's (specdoctor/workflow/serve.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from specdoctor.commands.options import Engine, EngineOption, passed_to_engine, runtime_command
from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.workflow.serve import ServeOptions, run_serve

HostOption = Annotated[str, typer.Option(help="Address to bind (loopback by default).")]
PortOption = Annotated[int, typer.Option(help="Port to listen on.")]
ApiKeyOption = Annotated[str | None, typer.Option(help="Require 'Authorization: Bearer KEY' on /v1.")]
MaxNumSeqsOption = Annotated[
    int, typer.Option(min=1, help="Requests decoded together at most (vLLM's --max-num-seqs); the rest wait.")
]
MaxWaitingOption = Annotated[
    int, typer.Option(min=0, help="Requests that may wait for a place; beyond that the server answers 429.")
]
ReasoningParserOption = Annotated[
    str | None,
    typer.Option(
        help="Split each chat reply's thinking from its content and start structured output after it, as vLLM's "
        "parser of this name does: 'hf' reads the checkpoint's response_template."
    ),
]
AllowUnhealthyFlag = Annotated[
    bool, typer.Option("--allow-unhealthy", help="Serve even with error findings, without repairing.")
]


# k: MTP 3, DSpark its block size; compiled, as vLLM serves by default (docs/performance.md: start-up times)
SERVE_DEFAULTS = dict(num_speculative_tokens=None, enable_prefix_caching=True, compile=True, adaptive_speculation=True)
DEFAULT_MAX_WAITING = 256


@runtime_command(**SERVE_DEFAULTS)
def serve(
    ctx: typer.Context,
    runtime: RuntimeOptions,
    host: HostOption = "127.0.0.1",
    port: PortOption = 8000,
    api_key: ApiKeyOption = None,
    allow_unhealthy: AllowUnhealthyFlag = False,
    max_num_seqs: MaxNumSeqsOption = 32,
    max_waiting: MaxWaitingOption = DEFAULT_MAX_WAITING,
    reasoning_parser: ReasoningParserOption = None,
    engine: EngineOption = Engine.SPECDOCTOR,
) -> None:
    """Serve an OpenAI-compatible API with the drafter fixes applied and vLLM-style metrics; requests are
    batched continuously (they join and leave the running batch between decode steps). With --engine vllm, vLLM
    serves, its workers' drafters verified and repaired at load by specdoctor's plugin."""
    passed = passed_to_engine(ctx, engine)
    options = ServeOptions(runtime, host, port, api_key, allow_unhealthy, max_num_seqs, max_waiting, reasoning_parser)
    if engine is not Engine.VLLM:
        run_serve(options)
        return
    from specdoctor.workflow.vllm_args import refuse_runtime_only
    from specdoctor.workflow.vllm_serve import run_vllm_serve

    if max_waiting != DEFAULT_MAX_WAITING:
        raise SpecdoctorError("--max-waiting bounds specdoctor's own queue: vLLM queues requests its own way")
    refuse_runtime_only(runtime, RuntimeOptions(model=runtime.model, **SERVE_DEFAULTS))
    run_vllm_serve(options, passed)
