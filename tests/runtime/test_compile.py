"""`--compile`: decode passes through torch.compile give the tokens and acceptance counts of the eager
runtime with a fraction of its ops per step (one test: compiling costs tens of seconds on 2 cores)."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters
from torch.profiler import profile

from specdoctor.battery import battery_prompts
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.checkpoint.tokenizer import load_codec
from specdoctor.runtime.decode.batch import decode_batch
from specdoctor.runtime.decode.requests import GenerateRequest
from specdoctor.runtime.options import RuntimeOptions
from specdoctor.runtime.worker import load_rank


def decode_profiled(compile: bool, prompts: list[list[int]]) -> tuple[tuple, float]:
    """(tokens, finish reasons and acceptance counters, top-level ops per decode step) of one batch at k 3
    on a rank loaded as the runtime loads it."""
    model, _ = load_rank(RuntimeOptions("demo", num_speculative_tokens=3, compile=compile), 0)
    request = GenerateRequest(prompts, 24, num_speculative_tokens=3)
    decode_batch(model, request)  # with --compile: compiles the shapes of this batch
    with profile() as trace:
        result = decode_batch(model, request)
    ops = sum(1 for event in trace.events() if event.cpu_parent is None)
    return (result.tokens, result.finish_reasons, result.metrics.to_dict()), ops / result.rank_times[0]["steps"]


@pytest.mark.timeout(600)
def test_compiled_decode_gives_the_eager_tokens_and_counts_with_fewer_ops():
    checkpoint = Checkpoint("demo")
    prompts = battery_prompts(None, checkpoint, load_codec(checkpoint, None))[0][:3]
    eager, eager_ops = decode_profiled(False, prompts)
    graphs_before = counters["stats"]["unique_graphs"]
    compiled, compiled_ops = decode_profiled(True, prompts)
    assert compiled == eager
    assert eager[2]["num_accepted_tokens"] > 0
    assert counters["stats"]["unique_graphs"] - graphs_before >= 3  # the stage's layers; the MTP layer at 4 and 1
    # The prompt pass, head, verification and bookkeeping stay eager; the layers become a few kernels.
    assert compiled_ops < eager_ops / 2, (compiled_ops, eager_ops)
