"""Runs inside the user's vLLM Python, started by `check --engine vllm` (engines/vllm/launch.py):

    python -m specdoctor.engines.vllm.driver RUNS.json RESULT.json

Each run is one start of vLLM, one after the other in this process, built from the run's command-line arguments
(the same flags as `vllm serve`). The battery runs greedily with vLLM's per-request speculative counters; with
`repair` the workers repair their drafter in place (collective_rpc, the plugin's `specdoctor_repair`) before the
battery runs again. A reference run (no speculative config) returns each generated token's raw logits for the
tie rule instead. The result file holds plain JSON; an error vLLM raises is written there as one line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from specdoctor.engines.vllm import REPORTS

TOP_LOGITS = 5  # the reference's raw logits kept per generated token: enough to tell a near-tie from a real miss


def engine_args(argv: list[str], speculative: bool):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm"))
    parser.error = refuse  # argparse would print usage and exit: the host wants vLLM's one line
    parsed = parser.parse_args(argv)
    args = EngineArgs.from_cli_args(parsed)
    if speculative:
        args.per_request_spec_decode_metrics = "summary"
    else:
        args.logprobs_mode, args.max_logprobs = "raw_logits", TOP_LOGITS
    return args


class VllmRefused(ValueError):
    """A flag vLLM's own parser refuses."""


def refuse(message: str):
    raise VllmRefused(message)


def battery(llm, prompts: list[list[int]], max_tokens: int, speculative: bool) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        detokenize=False,
        logprobs=None if speculative else TOP_LOGITS,
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    answers = []
    for output in outputs:
        completion = output.outputs[0]
        answer = {"tokens": list(completion.token_ids)}
        if speculative:
            answer["spec"] = counters(completion.spec_decode_metrics)
        else:
            answer["logits"] = [{str(t): entry.logprob for t, entry in step.items()} for step in completion.logprobs]
        answers.append(answer)
    return answers


def counters(metrics) -> dict:
    """One request's counters with the Prometheus names: `histogram[j]` counts the verify steps that accepted j."""
    if metrics is None:  # a request that never reached a verify step
        return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    histogram = list(metrics.histogram)
    return {
        "num_drafts": sum(histogram),
        "num_draft_tokens": metrics.num_draft_tokens,
        "num_accepted_tokens": sum(j * count for j, count in enumerate(histogram)),
        "num_accepted_tokens_per_pos": [sum(histogram[p + 1 :]) for p in range(len(histogram) - 1)],
    }


def run(request: dict) -> dict:
    """One start of vLLM: its workers' reports, the battery, and with `repair` the repair and the battery again."""
    import vllm
    from vllm import LLM

    speculative = request["speculative"]
    llm = LLM.from_engine_args(engine_args(request["vllm_args"], speculative))
    try:
        config = llm.llm_engine.vllm_config
        result = {
            "vllm": vllm.__version__,
            "dtype": str(config.model_config.dtype).removeprefix("torch."),
            "tp": config.parallel_config.tensor_parallel_size,
            "pp": config.parallel_config.pipeline_parallel_size,
        }
        reports = request.get("reports")  # each worker's, written as it loaded (a repair rewrites them)
        result["reports"] = {p.stem: json.loads(p.read_text()) for p in Path(reports).glob("*.json")} if reports else {}
        result["before"] = battery(llm, request["prompts"], request["max_tokens"], speculative)
        if request.get("repair"):
            result["repairs"] = llm.collective_rpc("specdoctor_repair")
            llm.reset_prefix_cache()  # blocks cached before the repair hold the broken drafter's K/V
            result["after"] = battery(llm, request["prompts"], request["max_tokens"], speculative)
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm  # the engine released before the process group is torn down


def run_all(runs: list[dict]) -> list[dict]:
    """The starts in order (one import of vLLM for all): the plugin on where a run names its reports' directory;
    between them vLLM's process group and memory are torn down, so the next start begins clean."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    results = []
    for request in runs:
        os.environ.pop(REPORTS, None)
        if request.get("reports"):
            os.environ[REPORTS] = request["reports"]
        results.append(run(request))
        cleanup_dist_env_and_memory()
    return results


def one_line(err: Exception) -> str:
    """The line of an exception's message that says what was wrong (pydantic, as vLLM's config validation
    raises it, ends with a link and puts the message before its `[type=...]` tag)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    lines = [line.split(" [type=")[0] for line in lines if not line.startswith("For further information")]
    return lines[-1] if lines else type(err).__name__


def main() -> None:
    request_path, result_path = map(Path, sys.argv[1:3])
    try:
        result = {"runs": run_all(json.loads(request_path.read_text()))}
    except Exception as err:  # vLLM's refusal (a flag, a model), or its engine dying: one line for the host
        result = {"error": f"{type(err).__name__}: {one_line(err)}"}
    partial = result_path.with_suffix(".partial")
    partial.write_text(json.dumps(result))
    partial.replace(result_path)


if __name__ == "__main__":
    main()
