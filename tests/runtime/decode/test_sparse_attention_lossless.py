"""Speculative decoding on DeepSeek-V3.2 and GLM-5 whose sparse attention really selects (`index_topk` 6 of
contexts of 20-43 tokens) and ties (two indexer heads: a quarter of the keys score exactly 0): at PP 1-4 and
k 1-5 the output equals target-only greedy output. A verify pass scores each query among k+1 over a longer
span than the one-query step of target-only decoding; a top-k whose choice among tied keys follows the pass's
shape (torch.topk's) gives other tokens here (docs/engine-semantics.md §DSA tie order). On the same engine,
check's evidence for a difference (checks/behaviour.py: the target's logits after the common prefix) reads
through the pipeline. One engine per PP size and architecture; every k runs on it."""

from __future__ import annotations

import pytest
import torch

from specdoctor.checks.behaviour import divergence_evidence
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions
from tests.helpers.sparse_attention import DSA_ARCHITECTURES, make_tied_checkpoint

GENERATOR = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(0, 320, (n,), generator=GENERATOR).tolist() for n in (20, 26, 31)]
NEW_TOKENS = 12
KS = (1, 2, 3, 4, 5)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """{architecture: checkpoint directory} with TIED's indexer."""
    made = {}
    for architecture in DSA_ARCHITECTURES:
        made[architecture] = tmp_path_factory.mktemp(architecture)
        make_tied_checkpoint(made[architecture], architecture, seed=1)
    return made


@pytest.mark.parametrize("pp", (1, 2, 3, 4))
@pytest.mark.parametrize("architecture", DSA_ARCHITECTURES)
def test_speculative_output_equals_target_only_output_with_a_selecting_indexer(tied, architecture, pp):
    options = RuntimeOptions(str(tied[architecture]), pp=pp, num_speculative_tokens=max(KS), drafter_policy="fixed")
    with Engine(options) as engine:
        plain = engine.generate(PROMPTS, NEW_TOKENS, num_speculative_tokens=0).tokens
        differing = {}
        for k in KS:
            result = engine.generate(PROMPTS, NEW_TOKENS, num_speculative_tokens=k)
            assert result.metrics.num_draft_tokens == k * result.metrics.num_drafts > 0
            differing[k] = [row for row, (a, b) in enumerate(zip(plain, result.tokens, strict=True)) if a != b]
        # check's evidence for a difference, read through this pipeline: a token the target did not pick
        at = min(5, len(plain[0]) - 1)
        altered = [plain[0][:at] + [(plain[0][at] + 1) % 320]] + plain[1:]
        (evidence,) = divergence_evidence(engine, PROMPTS, plain, altered)
    assert differing == dict.fromkeys(KS, []), "prompts whose speculative output differs, by k"
    assert (evidence["prompt"], evidence["token"]) == (0, at) and not evidence["within_rounding"]
