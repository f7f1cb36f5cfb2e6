"""`behaviour.lossless` tells a rounding tie from a real divergence: where speculative output first differs from
target-only output, the target's logits there (one prompt pass over the prompt and the common prefix) decide.
The two tokens emitted within rounding of the best logit at every differing prompt: a warning naming each
prompt, token and gap; otherwise the error as before (docs/engine-semantics.md §DSA tie order)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.checks.behaviour import (
    ROUNDING_LOGIT_ULPS,
    behaviour_findings,
    divergence_evidence,
    first_difference,
    run_battery,
)
from specdoctor.checks.proposals import proposal_profile
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.drafter.mtp import MtpKind
from specdoctor.runtime.options import Dtype

VOCAB, EOS = 16, 15
PROMPTS = [[1, 2, 3], [4, 5], [6]]
PLAIN = [[7, 8, 9, 10], [11, 12, 13], [7, 7]]
EPS32 = torch.finfo(torch.float32).eps


class FakeEngine:
    """An engine whose speculative run emits `speculative`, and whose target's logits where prompt r's outputs
    first differ are 4.0 for the target-only token, 4.0 - gaps[r] for the speculative one (EOS where an
    output ended) and 0 elsewhere."""

    def __init__(self, speculative, gaps: dict[int, float], dtype=Dtype.FLOAT32, recurrent: int = 0):
        self.speculative, self.gaps = speculative, gaps
        self.options = SimpleNamespace(dtype=dtype)
        self.eos_token_ids = (EOS,)
        self.config = SimpleNamespace(num_hidden_layers=2, is_linear_attention=lambda i: i < recurrent)
        self.drafter = MtpKind(target=None)  # a chain drafter: no block shape, no verdicts of its own
        self.scored: list[list[int]] = []

    def prompt_logits(self, prompts):
        self.scored += prompts
        logits = torch.zeros(len(prompts), max(map(len, prompts)), VOCAB)
        for n, prefix in enumerate(prompts):
            row = next(r for r, p in enumerate(PROMPTS) if prefix[: len(p)] == p)
            at = len(prefix) - len(PROMPTS[row])
            ours, theirs = [output[at] if at < len(output) else EOS for output in (PLAIN[row], self.speculative[row])]
            logits[n, len(prefix) - 1, ours] = 4.0
            logits[n, len(prefix) - 1, theirs] = 4.0 - self.gaps[row]
        return logits

    def generate(self, prompts, max_tokens, num_speculative_tokens):
        metrics = SpecMetrics()
        for _ in range(10):
            metrics.record(1, num_speculative_tokens)
        return SimpleNamespace(tokens=self.speculative, metrics=metrics, proposals=[1, 2, 3])


def test_first_difference_is_the_first_token_or_where_the_shorter_output_ends():
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 9]) == 2
    assert first_difference([], [4]) == 0


def test_evidence_reads_the_target_logits_after_the_common_prefix():
    speculative = [[7, 8, 14, 10], PLAIN[1], [7]]  # prompt 0 at token 2; prompt 2 ended (EOS) at token 1
    tiny = 2 * EPS32 * 4.0  # 2 units of float32 at the best logit 4.0
    engine = FakeEngine(speculative, {0: tiny, 2: 0.5})
    evidence = divergence_evidence(engine, PROMPTS, PLAIN, speculative)
    assert engine.scored == [[1, 2, 3, 7, 8], [6, 7]]  # a prompt pass each: the prompt and the tokens both emitted
    where = [(d["prompt"], d["token"], d["target"], d["speculative"]) for d in evidence]
    assert where == [(0, 2, 9, 14), (2, 1, 7, None)]
    assert evidence[0]["gap"] == pytest.approx(tiny) and evidence[0]["within_rounding"]
    assert evidence[0]["tolerance"] == pytest.approx(ROUNDING_LOGIT_ULPS * EPS32 * 4.0)
    assert evidence[1]["gap"] == 0.5 and not evidence[1]["within_rounding"]  # the EOS token's logit decides
    assert divergence_evidence(engine, PROMPTS, PLAIN, PLAIN) == []


def test_the_tolerance_follows_the_compute_dtype():
    speculative = [[7, 8, 14, 10], PLAIN[1], PLAIN[2]]
    gap = 0.05  # far beyond float32 rounding at 4.0, within bfloat16's (eps 2^-7: 16 units = 0.5)
    assert not divergence_evidence(FakeEngine(speculative, {0: gap}), PROMPTS, PLAIN, speculative)[0]["within_rounding"]
    bf16 = FakeEngine(speculative, {0: gap}, Dtype.BFLOAT16)
    assert divergence_evidence(bf16, PROMPTS, PLAIN, speculative)[0]["within_rounding"]


def findings_of(engine):
    report = run_battery(engine, PROMPTS, PLAIN, 4, 3, DEFAULT_MIN_ACCEPTANCE_LENGTH, "before")
    return report, [f for f in report["findings"] if f.check.startswith("behaviour.lossless")]


def test_every_difference_within_rounding_is_a_warning_naming_position_and_gap():
    speculative = [[7, 8, 14, 10], [11, 3, 13], PLAIN[2]]
    report, findings = findings_of(FakeEngine(speculative, {0: 2**-20, 1: 0.0}, recurrent=1))
    assert report["battery"] == "1/3" and report["lossless"] == [False, False, True]
    assert [(f.check, f.severity) for f in findings] == [("behaviour.lossless", "warning")]
    assert "differs from target-only output on 2 of 3 prompts" in findings[0].message
    assert "prompt 0 at token 2 (gap 9.5e-07); prompt 1 at token 1 (gap 0)" in findings[0].message
    assert [d["prompt"] for d in findings[0].data["divergences"]] == [0, 1]
    assert not [f for f in report["findings"] if f.severity == "error"]  # nor behaviour.state_rollback


def test_one_real_divergence_keeps_the_error():
    speculative = [[7, 8, 14, 10], [11, 3, 13], PLAIN[2]]
    report, findings = findings_of(FakeEngine(speculative, {0: 2**-20, 1: 2.0}, recurrent=1))
    assert [(f.check, f.severity) for f in findings] == [("behaviour.lossless", "error")]
    assert findings[0].message == "speculative output differs from target-only output on 2 of 3 prompts"
    assert [d["within_rounding"] for d in findings[0].data["divergences"]] == [True, False]
    assert "behaviour.state_rollback" in [f.check for f in report["findings"] if f.severity == "error"]


def test_without_evidence_every_difference_is_an_error():
    metrics = SpecMetrics()
    metrics.record(0, 1)
    findings = behaviour_findings(
        [False, True], metrics.to_dict(), proposal_profile([1]), 1, DEFAULT_MIN_ACCEPTANCE_LENGTH, "before"
    )
    assert (findings[0].check, findings[0].severity) == ("behaviour.lossless", "error")
