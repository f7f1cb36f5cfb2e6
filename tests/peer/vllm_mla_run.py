"""vLLM's own tokens and speculative counters for an MLA model (DeepSeek-V3 family), printed as JSON. Runs
inside the peer environment (vLLM installed, specdoctor not):

    python tests/peer/vllm_mla_run.py MODEL_DIR K MAX_TOKENS '[[token ids], ...]'

Offline engine, PP 1, fp32, greedy, MTP with K drafts; each prompt runs alone, and its counters are the
difference of vLLM's own metrics around it. vLLM's AMX MLA backend (chosen when the CPU has AMX tiles)
refuses fp32 weights, so it is switched off and vLLM's CPU_MLA backend runs.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process, so the AMX setting applies
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def counters(llm) -> dict:
    values = {}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            values[name] = metric.value
        elif name == "num_accepted_tokens_per_pos":
            values[name] = list(metric.values)
    return values


def main() -> None:
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model, k, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=256,  # the test checkpoints' max_position_embeddings
        distributed_executor_backend="uni",
        enforce_eager=True,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, detokenize=False)
    rows = []
    for ids in prompts:
        before = counters(llm)
        output = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        after = counters(llm)
        spec = {name: after[name] - before.get(name, 0) for name in after if name != "num_accepted_tokens_per_pos"}
        per_pos_before = before.get("num_accepted_tokens_per_pos") or [0] * k
        spec["num_accepted_tokens_per_pos"] = [
            a - b for a, b in zip(after["num_accepted_tokens_per_pos"], per_pos_before, strict=True)
        ]
        rows.append({"tokens": list(output.outputs[0].token_ids), **spec})
    print("RESULT " + json.dumps(rows))


if __name__ == "__main__":
    main()
