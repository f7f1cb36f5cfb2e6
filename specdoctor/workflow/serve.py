"""`serve`'s start-up: open the checkpoint, start the ranks with the fixed loading, check the drafter (and repair
it), then serve HTTP; with --compile, warm up every shape a request can meet while the graphs compile behind it."""

from __future__ import annotations

import functools
import socket
import time
from dataclasses import dataclass

from rich.console import Console

from specdoctor.errors import SpecdoctorError
from specdoctor.report import Finding
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.workflow.compile_progress import CompileProgress
from specdoctor.workflow.drafter import examine_drafter
from specdoctor.workflow.examine_and_repair import examine_and_repair


@dataclass(frozen=True)
class ServeOptions:
    runtime: RuntimeOptions
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_unhealthy: bool = False
    max_num_seqs: int = 32
    max_waiting: int = 256
    reasoning_parser: str | None = None  # vLLM's name of one (server/reasoning.py)


TAP_PROBE = list(range(1, 17))  # token ids for the startup tap probe (every vocabulary has them)
# One core stays with this process (HTTP, text, scheduling), as vLLM's CPU backend keeps cores for its scheduler
# (one per worker): a rank's spinning threads otherwise take it from every request (docs/performance.md: serving).
HOST_CORES = 1


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise SpecdoctorError(f"cannot listen on {host}:{port} ({err.strerror})") from None


def run_serve(options: ServeOptions) -> None:
    from specdoctor.runtime.checkpoint.files import DEMO_MODELS
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.checkpoint.tokenizer import load_codec, tokenizer_file
    from specdoctor.runtime.engine import Engine
    from specdoctor.runtime.partition import placements
    from specdoctor.server.app import ServerState, serve_http
    from specdoctor.server.metrics import ServerMetrics
    from specdoctor.server.protocol import chat_template
    from specdoctor.server.reasoning import reasoning_template

    console = Console(stderr=True)
    runtime = options.runtime
    checkpoint = Checkpoint(runtime.model)
    checkpoint.require_runnable()
    placements(checkpoint.config, runtime.pp, runtime.pp_partition)  # bad flags fail before anything starts
    codec = load_codec(checkpoint, runtime.tokenizer, needed_for="to serve text")
    tokenizer_dir = tokenizer_file(checkpoint.path, runtime.tokenizer).parent  # its templates, as vLLM reads them
    parser = options.reasoning_parser
    reasoning = reasoning_template(parser, tokenizer_dir, codec) if parser else None
    check_port_free(options.host, options.port)
    name = options.runtime.model if options.runtime.model in DEMO_MODELS else checkpoint.path.name
    console.print(f"loading {name} on {runtime.tp * runtime.pp} rank(s)", highlight=False)
    engine = Engine(runtime, checkpoint, show_progress=True, host_cores=HOST_CORES)
    runtime = engine.options  # the draft tokens resolved (a DSpark drafter's block size by default)
    try:
        errors = startup_check(engine, not options.allow_unhealthy, TAP_PROBE, console)
        for finding in errors:
            console.print(f"[red]error[/red] {finding.check}: {finding.message}", highlight=False)
        if errors and not options.allow_unhealthy:
            raise SpecdoctorError(f"refusing to start: {errors[0].message} (--allow-unhealthy serves anyway)")
        speculative = runtime.num_speculative_tokens > 0
        metrics = ServerMetrics(name, speculative, compiled=runtime.compile)
        template = chat_template(tokenizer_dir)
        limits = (options.max_num_seqs, options.max_waiting)
        state = ServerState(engine, codec, name, template, options.api_key, metrics, *limits, reasoning)
        listening = (
            f"serving {name} on http://{options.host}:{options.port} (TP {runtime.tp} × PP {runtime.pp}, "
            f"k {runtime.num_speculative_tokens}, {engine.rank_info[0]['threads']} compute thread(s) a rank"
            + (", eager until the graphs compiled behind it are in)" if runtime.compile else ")")
        )
        warm_up = None
        if runtime.compile:
            warm_up = functools.partial(warm_up_shapes, engine, options.max_num_seqs, CompileProgress(console))
        serve_http(state, options.host, options.port, lambda: console.print(listening, highlight=False), warm_up)
    finally:
        engine.close()  # at once on Ctrl-C or SIGTERM before serving (loading, checking, compiling)


def startup_check(engine, repair: bool, tap_prompt: list[int], console: Console) -> list[Finding]:
    """The pre-flight and the loaded-drafter examination on the engine `serve` serves from; with `repair`, what a
    checkpoint read fixes is repaired and examined again. Returns the error findings left."""
    from specdoctor.checks.preflight import preflight
    from specdoctor.runtime.drafter.repair import RepairResult

    errors = [f for f in preflight(engine.checkpoint, engine.placements, engine.drafter) if f.severity == "error"]
    if engine.options.num_speculative_tokens == 0 or not engine.speculates:
        return errors

    def repair_on_engine(broken):
        if not any(broken.values()):  # nothing to read: no order to the ranks on the way to serving
            return RepairResult()
        result = engine.repair_drafter(broken)
        console.print(f"repaired {', '.join(result.repaired)} from the checkpoint ({result.bytes_read:,} bytes)")
        return result

    examine = functools.partial(examine_drafter, engine, tap_prompt=tap_prompt)
    checked = examine_and_repair(examine, repair_on_engine if repair else None, ("startup", "startup"))
    return errors + [f for f in checked.last.findings if f.severity == "error"]


def warm_up_shapes(engine, max_num_seqs: int, progress: CompileProgress) -> None:
    """--compile: run each shape of prompt pass and decode step a request can meet once, eager, before the first
    request joins (seconds), so the ranks' compile threads have every graph to make before traffic meets it: two-token
    prompts at batch 1 and the powers of two up to a full batch, then one-token prompts, and prompts past the length
    where the MoE layers switch paths (`warmup_prompts`). Then `progress` shows the compile until every graph is in."""
    from specdoctor.runtime.compile import graph_cache_dir
    from specdoctor.runtime.warmup import warmup_prompts

    k = engine.options.num_speculative_tokens
    # with adaptive speculation, every kind of step: four steps emit at most 2k + 4 tokens (GenerateRequest)
    cycled = engine.options.adaptive_speculation and k > 0
    batches = warmup_prompts(max_num_seqs, engine.gathered_token_limit, engine.grouped_from)
    started = time.perf_counter()
    for prompts in batches:
        engine.generate(prompts, 2 * k + 4 if cycled else 4, num_speculative_tokens=k, every_step_kind=cycled)
    progress.console.print(
        f"warmed up {len(batches)} batch shapes eager in {time.perf_counter() - started:.1f} s (k {k}); their graphs "
        f"compile behind serving, kept in {graph_cache_dir()}",
        highlight=False,
    )
    engine.on_compile_status = progress.update
    progress.update(engine.compile_status)
