"""`generate`: prompts through the pipeline runtime (under torchrun, this process is one rank), and the report of
what came out with the acceptance metrics."""

from __future__ import annotations

import dataclasses

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.options import RuntimeOptions


def run_generate(runtime: RuntimeOptions, prompts: list[str], max_tokens: int, sampling, show_progress: bool):
    """Generate for every prompt; returns the report (None on the non-zero ranks under torchrun)."""
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.checkpoint.tokenizer import load_codec
    from specdoctor.runtime.decode.requests import GenerateRequest
    from specdoctor.runtime.engine import Engine
    from specdoctor.runtime.torchrun import launched_by_torchrun, run_under_torchrun

    if not prompts:
        raise SpecdoctorError("give at least one --prompt or --prompts-file")
    checkpoint = Checkpoint(runtime.model)
    checkpoint.require_runnable()
    codec = load_codec(checkpoint, runtime.tokenizer, needed_for="to turn prompts into tokens")
    ids = [codec.encode(p) for p in prompts]
    if launched_by_torchrun():
        k = runtime.num_speculative_tokens
        request = GenerateRequest(
            ids, max_tokens, sampling, k, codec.eos_token_ids, draft_sample_method=runtime.draft_sample_method
        )
        result = run_under_torchrun(dataclasses.replace(runtime, model=str(checkpoint.path)), request)
    else:
        with Engine(runtime, checkpoint, show_progress=show_progress) as engine:
            result = engine.generate(ids, max_tokens, sampling)
    return None if result is None else build_report(runtime, prompts, codec, result)


def build_report(runtime: RuntimeOptions, prompts: list[str], codec, result) -> dict:
    return {
        "model": runtime.model,
        "tp": runtime.tp,
        "pp": runtime.pp,
        "num_speculative_tokens": runtime.num_speculative_tokens,
        "drafter_policy": str(runtime.drafter_policy),
        "outputs": [
            {"prompt": prompt, "completion": codec.decode(tokens), "tokens": tokens, "finish_reason": reason}
            for prompt, tokens, reason in zip(prompts, result.tokens, result.finish_reasons, strict=True)
        ],
        "metrics": result.metrics.to_dict(),
    }
