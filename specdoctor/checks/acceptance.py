"""Acceptance thresholds and the signatures of a broken drafter: one copy, used by `check`'s
behaviour stage and by `probe` (docs/engine-semantics.md §Normal acceptance).

Mean acceptance length counts the bonus token, so 1.0 means no draft was ever accepted.
"""

from __future__ import annotations

from specdoctor.report import Finding

# Broken drafters measure 1.00-1.14 on the demo, healthy ones >= 1.8 at every k.
DEFAULT_MIN_ACCEPTANCE_LENGTH = 1.4
# A drafter fed garbage (zeros, another weight's bytes) still guesses 0-14 % of first drafts from the
# target's hidden state alone; a healthy one several times that.
BROKEN_MEAN_LENGTH = 1.2
BROKEN_POSITION0_RATE = 0.2
# The chain is broken when position 0 is healthy but position 1 keeps under a quarter of its rate.
CHAIN_HEALTHY_POSITION0 = 0.3
CHAIN_DROP_RATIO = 0.25

BROKEN_HINT = (
    "an uninitialised or aliased drafter embedding, or missing drafter weights: run specdoctor check --repair "
    "on the checkpoint"
)
LOW_HINT = "a healthy MTP drafter accepts most position-0 drafts (DeepSeek-V3 k=1: 85-90 %)"
CHAIN_HINT = "the multi-step chain is fed the wrong hidden state or norm"


def is_broken(mean: float, rates: list[float]) -> bool:
    """The signature of a drafter with garbage or missing weights (rates may be unknown: [])."""
    return mean < BROKEN_MEAN_LENGTH and (not rates or rates[0] < BROKEN_POSITION0_RATE)


def is_chain_broken(rates: list[float]) -> bool:
    return len(rates) >= 2 and rates[0] >= CHAIN_HEALTHY_POSITION0 and rates[1] < CHAIN_DROP_RATIO * rates[0]


def acceptance_findings(
    prefix: str, summary: str, mean: float, rates: list[float], min_length: float, stage: str
) -> list[Finding]:
    """`{prefix}.acceptance` (an error below `min_length`, naming the broken-drafter signature when it
    matches) and `{prefix}.chain` (a warning when only the chain collapses). `summary`: the figures."""
    if mean < min_length:
        broken = is_broken(mean, rates)
        findings = [
            Finding(
                f"{prefix}.acceptance",
                "error",
                f"{summary}: below {min_length}" + (": drafter broken" if broken else ""),
                BROKEN_HINT if broken else LOW_HINT,
                stage,
                {"mean_acceptance_length": mean},
            )
        ]
    else:
        findings = [Finding(f"{prefix}.acceptance", "info", summary, stage=stage)]
    if is_chain_broken(rates):
        message = f"acceptance drops from {rates[0]:.0%} at position 0 to {rates[1]:.0%} at position 1"
        findings.append(Finding(f"{prefix}.chain", "warning", message, CHAIN_HINT, stage))
    return findings
