"""Behaviour: the correctness battery run with speculative decoding, against target-only output."""

from __future__ import annotations

from specdoctor.checks.acceptance import acceptance_findings, bigram_baseline, block_findings
from specdoctor.checks.proposals import CONSTANT_PROPOSALS_MIN_COUNT, CONSTANT_PROPOSALS_SHARE, proposal_profile
from specdoctor.checks.registry import checks_of
from specdoctor.report import Finding

# Where speculative output first differs, a gap between the target's best logit and the weaker of the two tokens
# emitted there of at most this many units of the compute dtype's precision (eps · max(1, |best logit|)) is a
# rounding tie: the two pass shapes (a k+1-query verify pass, a one-query step) round it differently.
ROUNDING_LOGIT_ULPS = 16


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
    divergences = divergence_evidence(engine, prompts, plain, result.tokens)
    findings = behaviour_findings(lossless, metrics, profile, k, min_length, stage, baseline, recurrent, divergences)
    if engine.drafter.drafts_in_blocks:  # the shape of its block tells the faults apart
        findings += block_findings("behaviour", metrics["per_position_acceptance_rate"], baseline, stage)
    # The kind's own verdicts (a draft model's: an engine's length gate) are named first: they are the verdict.
    longest = max(map(len, prompts)) + max_tokens
    findings = checks_of(engine.drafter).behaviour(engine.drafter, profile, longest, k, stage) + findings
    return {
        "battery": f"{sum(lossless)}/{len(lossless)}",
        "lossless": lossless,
        "divergences": divergences,
        "metrics": metrics,
        "proposals": profile,
        "bigram_baseline": baseline,
        "findings": findings,
    }


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where two outputs differ (the shorter one's length if one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def divergence_evidence(engine, prompts, plain, speculative) -> list[dict]:
    """Per prompt whose speculative output differs from target-only output: the first token where they differ
    and the target's logits there, from a prompt pass over the prompt and the common prefix (one prompt at a time:
    the logits come back for every position, and at once for many prompts they could fill memory). `gap`: the
    best logit minus the weaker of the two tokens emitted there (an output that ended there emitted its best
    EOS token); `within_rounding`: gap <= ROUNDING_LOGIT_ULPS units of the compute dtype at that logit."""
    import torch

    rows = [row for row, (a, b) in enumerate(zip(plain, speculative, strict=True)) if a != b]
    if not rows:
        return []
    eps, eos = torch.finfo(engine.options.dtype.torch()).eps, list(engine.eos_token_ids)
    evidence = []
    for row in rows:
        at = first_difference(plain[row], speculative[row])
        prefix = prompts[row] + plain[row][:at]
        scores = engine.prompt_logits([prefix])[0, len(prefix) - 1].float()
        emitted = [output[at] if at < len(output) else None for output in (plain[row], speculative[row])]
        chosen = [float(scores[t]) if t is not None else float(scores[eos].max()) if eos else None for t in emitted]
        evidence.append(tie_record(row, at, emitted, chosen, float(scores.max()), eps))
    return evidence


def tie_record(row: int, at: int, emitted: list, chosen: list, best: float, eps: float) -> dict:
    """Where prompt `row`'s outputs first differ (token `at`, the tokens each `emitted` there): `chosen` the
    target's logits of those tokens (None: unknown), `best` its best logit there, `eps` the compute dtype's."""
    gap = best - min(chosen) if None not in chosen else None  # None: an output ended where no EOS is known
    tolerance = ROUNDING_LOGIT_ULPS * eps * max(1.0, abs(best))
    return {
        "prompt": row,
        "token": at,
        "target": emitted[0],
        "speculative": emitted[1],
        "gap": gap,
        "tolerance": tolerance,
        "within_rounding": gap is not None and gap <= tolerance,
    }


def rounding_ties_only(divergences) -> bool:
    """Every difference has evidence (divergence_evidence's) that it begins within rounding: none is real."""
    return bool(divergences) and all(d["within_rounding"] for d in divergences)


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
    lossless, metrics, profile, k, min_length, stage, baseline=None, recurrent_layers: int = 0, divergences=()
) -> list[Finding]:
    """`recurrent_layers`: how many of the target's layers carry a recurrent state (hybrid models);
    `divergences`: divergence_evidence of the prompts that differ (none: every difference counts as real)."""
    findings = []
    mean, rates = metrics["mean_acceptance_length"], metrics["per_position_acceptance_rate"]
    passed = sum(lossless)
    if passed < len(lossless) and rounding_ties_only(divergences):
        findings.append(rounding_finding(list(divergences), len(lossless), stage))
    elif passed < len(lossless):
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
                {"divergences": list(divergences)},
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


def rounding_finding(ties: list[dict], prompts: int, stage: str) -> Finding:
    """Every difference starts where the target's two best tokens are within rounding of each other."""
    where = "; ".join(f"prompt {d['prompt']} at token {d['token']} (gap {d['gap']:.2g})" for d in ties)
    return Finding(
        "behaviour.lossless",
        "warning",
        f"speculative output differs from target-only output on {len(ties)} of {prompts} prompts, each first "
        f"where the target's top-2 logits are within rounding: {where}",
        "a near-tie the verify pass (k+1 queries) and the one-token step round differently, not a fault of the "
        "drafter or the engine; on a DSA model its indexer's top-k boundary can tie too (docs/engine-semantics.md "
        "§DSA tie order)",
        stage,
        {"divergences": ties},
    )
