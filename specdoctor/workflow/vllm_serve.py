"""`serve --engine vllm`: the user's vLLM serves, with specdoctor's plugin in every worker, in repair mode: the
deployment comes up with each worker's drafter tables verified against the checkpoint and repaired in place, or
it does not come up (exit 2, one line per table still wrong, naming its worker). The API, metrics, scale and nodes are
vLLM's; `probe` against it is the end-to-end check."""

from __future__ import annotations

from rich.console import Console

from specdoctor.engines.vllm import launch
from specdoctor.errors import SpecdoctorError
from specdoctor.workflow.vllm_args import vllm_arguments


def run_vllm_serve(options, passed: list[str]) -> None:
    """`options`: serve's ServeOptions; `passed`: the user's own vLLM flags."""
    from specdoctor.engines.worker_check import still_broken
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import drafter_kind, speculative_tokens

    launch.installed_vllm()
    runtime = options.runtime
    checkpoint = Checkpoint(runtime.model)
    drafter = drafter_kind(checkpoint, runtime.model, runtime.speculative_model, runtime.speculative_method)
    if drafter is None:
        raise SpecdoctorError(f"{checkpoint.path}: no drafter to serve with (no MTP layers, no --speculative-model)")
    k = speculative_tokens(drafter, runtime.num_speculative_tokens)
    arguments = vllm_arguments(runtime, checkpoint, drafter, k, passed, token_ids_only=False)
    arguments += ["--host", options.host, "--port", str(options.port), "--max-num-seqs", str(options.max_num_seqs)]
    arguments += ["--api-key", options.api_key] if options.api_key else []
    arguments += ["--reasoning-parser", options.reasoning_parser] if options.reasoning_parser else []
    code, reports = launch.serve_vllm(arguments, repair=not options.allow_unhealthy)
    broken = [f"{name}: {line}" for name, report in sorted(reports.items()) for line in still_broken(report)]
    # serve refuses to start, as its own runtime does: exit 2, a line per tensor and worker
    if code != 0 and broken and not options.allow_unhealthy:
        console = Console(stderr=True, soft_wrap=True)
        for line in broken:
            console.print(f"specdoctor: error: the drafter cannot be repaired on vLLM worker {line}", markup=False)
        raise SystemExit(2)
    if code != 0:
        raise SpecdoctorError(f"--engine vllm: vLLM's server stopped (exit {code}); its output is above")
