"""`specdoctor serve`: start the ranks with the fixed loading, check the drafter, then serve HTTP."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from rich.console import Console

from specdoctor.checks.preflight import preflight
from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.partition import placements
from specdoctor.runtime.tokenizer import TextCodec


@dataclass(frozen=True)
class ServeOptions:
    model: str
    pp: int = 1
    pp_partition: str | None = None
    num_speculative_tokens: int = 3
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allow_unhealthy: bool = False
    drafter_policy: str = "fixed"
    head_policy: str = "fixed"
    fill: str = "empty"
    device: str = "cpu"
    dtype: str = "float32"
    timeout_s: float = 60.0


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise SpecdoctorError(f"cannot listen on {host}:{port} ({err.strerror})") from None


def startup_check(engine: Engine, checkpoint: Checkpoint, options: ServeOptions, console: Console) -> list:
    """Pre-flight and the loaded-drafter checks; repair what can be repaired unless told to serve as is.
    Returns the error findings that remain."""
    errors = [f for f in preflight(checkpoint, engine.placements) if f.severity == "error"]
    if options.num_speculative_tokens == 0 or checkpoint.config.num_nextn_predict_layers == 0:
        return errors
    drafter = engine.drafter_command("inspect_drafter", stage="startup")
    broken = drafter["broken"]
    if broken and not options.allow_unhealthy:
        repair = engine.drafter_command("repair_drafter", names=broken)
        console.print(f"repaired {', '.join(repair['repaired'])} from the checkpoint ({repair['bytes_read']:,} bytes)")
        drafter = engine.drafter_command("inspect_drafter", stage="startup")
    return errors + [f for f in drafter["findings"] if f.severity == "error"]


def run_serve(options: ServeOptions) -> None:
    import uvicorn

    from specdoctor.server.app import ServerState, create_app
    from specdoctor.server.metrics import ServerMetrics
    from specdoctor.server.protocol import chat_template

    console = Console(stderr=True)
    checkpoint = Checkpoint(options.model)
    placements(checkpoint.config, options.pp, options.pp_partition)  # bad flags fail before anything starts
    codec = TextCodec(checkpoint.path, checkpoint.config.eos_token_ids)
    check_port_free(options.host, options.port)
    engine = Engine.from_options(
        options, checkpoint, num_speculative_tokens=options.num_speculative_tokens, show_progress=True
    )
    try:
        errors = startup_check(engine, checkpoint, options, console)
        for finding in errors:
            console.print(f"[red]error[/red] {finding.check}: {finding.message}", highlight=False)
        if errors and not options.allow_unhealthy:
            raise SpecdoctorError(f"refusing to start: {errors[0].message} (--allow-unhealthy serves anyway)")
        name = "demo" if options.model == "demo" else checkpoint.path.name
        speculative = options.num_speculative_tokens > 0
        state = ServerState(
            engine, codec, name, chat_template(checkpoint.path), options.api_key, ServerMetrics(name, speculative)
        )
        console.print(
            f"serving {name} on http://{options.host}:{options.port} (PP {options.pp}, "
            f"k {options.num_speculative_tokens})",
            highlight=False,
        )
        uvicorn.run(create_app(state), host=options.host, port=options.port, log_level="warning")
    finally:
        engine.close()
