"""Behaviour: the correctness battery run with speculative decoding, against target-only output."""

from __future__ import annotations

import math
from collections import Counter

from specdoctor.checks.acceptance import acceptance_findings, bigram_baseline, block_findings
from specdoctor.report import Finding

CONSTANT_PROPOSALS_MIN_COUNT = 20  # drafts needed before their spread means anything
CONSTANT_PROPOSALS_SHARE = 0.5  # one token in half of the drafts: the drafter ignores its context


def proposal_profile(proposals: list[int]) -> dict:
    """How varied the drafter's proposals are: share of the most frequent token and entropy in bits."""
    if not proposals:
        return {"count": 0, "top_token": None, "top_share": 0.0, "entropy_bits": 0.0}
    counts = Counter(proposals)
    token, top = counts.most_common(1)[0]
    total = len(proposals)
    entropy = -sum(n / total * math.log2(n / total) for n in counts.values())
    return {"count": total, "top_token": token, "top_share": top / total, "entropy_bits": entropy}


def run_battery(
    engine,
    prompts: list[list[int]],
    plain: list[list[int]],
    max_tokens: int,
    k: int,
    min_length: float,
    stage: str,
) -> dict:
    result = engine.generate(prompts, max_tokens, num_speculative_tokens=k)
    lossless = [a == b for a, b in zip(plain, result.tokens, strict=True)]
    metrics = result.metrics.to_dict()
    config = engine.config
    recurrent = sum(config.is_linear_attention(i) for i in range(config.num_hidden_layers))
    profile = proposal_profile(result.proposals)
    baseline = bigram_baseline(plain)  # how predictable the target's own output is, token by token
    findings = behaviour_findings(lossless, metrics, profile, k, min_length, stage, baseline, recurrent)
    if engine.drafter.drafts_in_blocks:  # the shape of its block tells the faults apart
        findings += block_findings("behaviour", metrics["per_position_acceptance_rate"], baseline, stage)
    return {
        "battery": f"{sum(lossless)}/{len(lossless)}",
        "lossless": lossless,
        "metrics": metrics,
        "proposals": profile,
        "bigram_baseline": baseline,
        "findings": findings,
    }


def crashed_battery(error: str, stage: str) -> dict:
    """The behaviour stage of a drafter whose first draft step brought the pipeline down."""
    first_line = error.strip().splitlines()[0] if error.strip() else "unknown error"
    finding = Finding(
        "behaviour.crash",
        "error",
        f"speculative decoding crashed the pipeline: {first_line}",
        "the drafter holds something that is not a weight (see drafter.alias); the engine dies on the first "
        "request, as vLLM's does; repair the drafter (specdoctor check --repair)",
        stage,
        {"error": error},
    )
    return {"battery": "crashed", "lossless": [], "metrics": None, "proposals": None, "findings": [finding]}


def behaviour_findings(
    lossless, metrics, profile, k, min_length, stage, baseline=None, recurrent_layers: int = 0
) -> list[Finding]:
    """`recurrent_layers`: how many of the target's layers carry a recurrent state (hybrid models)."""
    findings = []
    mean, rates = metrics["mean_acceptance_length"], metrics["per_position_acceptance_rate"]
    passed = sum(lossless)
    if passed < len(lossless):
        hint = "positions or KV caches drift between pipeline ranks, or the verifier compares NaN logits"
        if mean >= k + 1 - 1e-9:
            hint = "mean length equals k+1 with wrong text: NaN logits compare equal in a broken verifier"
        findings.append(
            Finding(
                "behaviour.lossless",
                "error",
                f"speculative output differs from target-only output on {len(lossless) - passed} "
                f"of {len(lossless)} prompts",
                hint,
                stage,
            )
        )
        if recurrent_layers:  # target-only decoding (one token a step) never has anything to roll back
            findings.append(
                Finding(
                    "behaviour.state_rollback",
                    "error",
                    f"speculative output diverges on a hybrid model ({recurrent_layers} linear-attention layers) "
                    "while target-only output is intact: rejected drafts stay in the recurrent state",
                    "the engine must restore each linear-attention layer's state to the one after the last accepted "
                    "token (keep the state per verified position, or recompute the accepted tokens)",
                    stage,
                )
            )
    else:
        findings.append(
            Finding(
                "behaviour.lossless",
                "info",
                f"battery {passed}/{len(lossless)}: speculative output identical to target-only output",
                stage=stage,
            )
        )
    summary = (
        f"mean acceptance length {mean:.2f} (counts the bonus token), acceptance rate {metrics['acceptance_rate']:.1%}"
    )
    findings += acceptance_findings("behaviour", summary, mean, rates, min_length, stage, baseline)
    if profile["count"] >= CONSTANT_PROPOSALS_MIN_COUNT and profile["top_share"] >= CONSTANT_PROPOSALS_SHARE:
        severity = "error" if mean < min_length else "warning"
        findings.append(
            Finding(
                "behaviour.constant_proposals",
                severity,
                f"{profile['top_share']:.0%} of {profile['count']} drafts are token {profile['top_token']} "
                f"(entropy {profile['entropy_bits']:.2f} bits)",
                "a drafter proposing one token regardless of context has garbage weights",
                stage,
            )
        )
    return findings
