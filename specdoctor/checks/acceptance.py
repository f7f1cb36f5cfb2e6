"""Acceptance thresholds and the signatures of a broken drafter: one copy, used by `check`'s behaviour
stage and by `probe` (docs/engine-semantics.md §Normal acceptance). Mean acceptance length counts the
bonus token, so 1.0 means no draft was ever accepted.

Where each number comes from (measured by benchmarks/acceptance.py and the fault matrix on the demo,
greedy, k 3, on the text battery and on the token-id battery):
- DEFAULT_MIN_ACCEPTANCE_LENGTH 1.4: broken drafters measure 1.00-1.15, healthy ones 1.83 at k 1 and
  2.70 at k 3; DeepSeek-V3's MTP at k 1 runs at about 1.9. 1.4 sits between, and is the user's to set.
- The broken signature compares the position-0 rate with a rate every model has: how often the
  target's next token is guessed from its previous token alone, by a bigram table of the target's own
  battery output (each prompt scored with the table of the others). A drafter whose embedding is
  garbage knows the context but not the newest token, and measures at most 0.92x that rate (0.00-0.14
  against 0.13-0.17); healthy drafters measure at least 4.1x (0.69-0.77). BROKEN_BASELINE_FACTOR 2 sits
  midway between the two on a log scale. Without a baseline (a probe of a server that returns no token
  ids) the floor BROKEN_POSITION0_RATE is used: the largest broken rate measured, 0.14, rounded up.
- The chain signature: a healthy chain keeps 0.69-0.80 of its rate from position 0 to 1; a rate that
  falls below a quarter of a healthy position 0 (>= 0.3) is far outside that.
- A block drafter (DSpark) drafts its whole block in one pass, and the shape of its per-position rates
  tells the faults apart. Measured on demo-dspark at PP 2-4, k 5, text battery: healthy 67 50 28 16 9 %
  (each position keeps 0.61 of the one before, geometric mean), taps off by one 0.61; every position
  collapsed (position 0 under the broken limit) for the head zeroed (13 %) or NaN, the Markov head
  zeroed (32 %: it also carries position 0's bigram) or NaN, and a NaN embedding (0 %); position 0
  holding and the block decaying for a zeroed or uninitialised embedding (56 31 11 5 4 %: keeps 0.50;
  the first demo-dspark drafter, trained less: 0.34 against a healthy 0.64) and, less, for two of three
  taps zeroed (0.55). BLOCK_DECAY_RETENTION 0.55 sits between the embedding faults and the healthy
  drafters; the margin is small and a weak healthy drafter decays too, so a decay is a warning: the
  content checks are what name the fault.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from specdoctor.report import Finding

DEFAULT_MIN_ACCEPTANCE_LENGTH = 1.4
BROKEN_BASELINE_FACTOR = 2.0
BROKEN_POSITION0_RATE = 0.2
CHAIN_HEALTHY_POSITION0 = 0.3
CHAIN_DROP_RATIO = 0.25
BLOCK_DECAY_RETENTION = 0.55

BROKEN_HINT = (
    "an uninitialised or aliased drafter embedding, or missing drafter weights: run specdoctor check --repair "
    "--model TARGET (with --speculative-model DIR for an EAGLE-3 head, a DSpark drafter or a draft model), "
    "which also names the engine's wiring faults (taps, aux layer ids, a draft model's position range)"
)
LOW_HINT = (
    "a healthy MTP layer or EAGLE-3 head accepts most position-0 drafts (DeepSeek-V3 MTP k=1: 85-90 %); "
    "a draft model past its position range drafts token 0 in vLLM"
)
CHAIN_HINT = "the multi-step chain is fed the wrong hidden state or norm"


def bigram_baseline(outputs: list[list[int]]) -> float | None:
    """How often a bigram table of the target's own outputs guesses each next token from the previous one,
    each output scored with the table of the others; None when there is nothing to score."""
    hits = scored = 0
    for index, sequence in enumerate(outputs):
        table: dict[int, Counter] = defaultdict(Counter)
        for other, tokens in enumerate(outputs):
            if other != index:
                for previous, following in zip(tokens, tokens[1:], strict=False):
                    table[previous][following] += 1
        for previous, following in zip(sequence, sequence[1:], strict=False):
            scored += 1
            hits += bool(table[previous]) and table[previous].most_common(1)[0][0] == following
    return hits / scored if scored else None


def broken_position0_limit(baseline: float | None) -> float:
    return BROKEN_POSITION0_RATE if baseline is None else BROKEN_BASELINE_FACTOR * baseline


def is_broken(mean: float, rates: list[float], baseline: float | None) -> bool:
    """The signature of a drafter with garbage or missing weights. Without per-position rates (SGLang
    reports only the mean), mean - 1 bounds the position-0 rate from above."""
    position0 = rates[0] if rates else mean - 1
    return position0 < broken_position0_limit(baseline)


def is_chain_broken(rates: list[float]) -> bool:
    return len(rates) >= 2 and rates[0] >= CHAIN_HEALTHY_POSITION0 and rates[1] < CHAIN_DROP_RATIO * rates[0]


def block_retention(rates: list[float]) -> float | None:
    """The share of each block position's rate the next one keeps, averaged geometrically over the positions
    after the first (rates are of whole accepted prefixes, so each is at most the one before); None when
    there is no later position or position 0 accepted nothing."""
    if len(rates) < 2 or rates[0] <= 0:
        return None
    return (rates[-1] / rates[0]) ** (1 / (len(rates) - 1))


def block_findings(prefix: str, rates: list[float], baseline: float | None, stage: str) -> list[Finding]:
    """`{prefix}.block`: the shape of a block drafter's per-position rates, a collapse at every position or
    a decay along the block (which faults give which: the module docstring)."""
    if len(rates) < 2:
        return []
    shown = " ".join(f"{rate:.0%}" for rate in rates)
    retention = block_retention(rates)
    data = {"per_position": rates, "retention": retention}
    if retention is None or rates[0] < broken_position0_limit(baseline):
        return [
            Finding(
                f"{prefix}.block",
                "error",
                f"every block position collapsed ({shown})",
                "what every position reads is broken: the drafter's head, its Markov head, a non-finite embedding, "
                "or its taps",
                stage,
                data,
            )
        ]
    if retention < BLOCK_DECAY_RETENTION:
        return [
            Finding(
                f"{prefix}.block",
                "warning",
                f"position 0 holds ({rates[0]:.0%}) but the block decays: each position keeps {retention:.0%} of the "
                f"one before ({shown})",
                "position 0 still reads the context but the later ones lose their own inputs: the drafter's token "
                "embedding (its anchor and mask tokens), or some of its taps",
                stage,
                data,
            )
        ]
    return [
        Finding(
            f"{prefix}.block", "info", f"block shape {shown} (keeps {retention:.0%} a position)", stage=stage, data=data
        )
    ]


def acceptance_findings(
    prefix: str, summary: str, mean: float, rates: list[float], min_length: float, stage: str, baseline=None
) -> list[Finding]:
    """`{prefix}.acceptance` (an error below `min_length`, naming the broken-drafter signature when it
    matches) and `{prefix}.chain` (a warning when only the chain collapses). `summary`: the figures;
    `baseline`: the bigram rate of the target's own output, when known."""
    data = {"mean_acceptance_length": mean, "bigram_baseline": baseline}
    if mean < min_length:
        broken = is_broken(mean, rates, baseline)
        limit = broken_position0_limit(baseline)
        signature = f": drafter broken (position 0 under {limit:.0%})" if broken else ""
        findings = [
            Finding(
                f"{prefix}.acceptance",
                "error",
                f"{summary}: below {min_length}{signature}",
                BROKEN_HINT if broken else LOW_HINT,
                stage,
                data,
            )
        ]
    else:
        findings = [Finding(f"{prefix}.acceptance", "info", summary, stage=stage, data=data)]
    if is_chain_broken(rates):
        message = f"acceptance drops from {rates[0]:.0%} at position 0 to {rates[1]:.0%} at position 1"
        findings.append(Finding(f"{prefix}.chain", "warning", message, CHAIN_HINT, stage))
    return findings
