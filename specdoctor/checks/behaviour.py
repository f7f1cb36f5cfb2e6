"""Behaviour: the correctness battery run with speculative decoding, against target-only output."""

from __future__ import annotations

import json
import math
from collections import Counter
from importlib import resources
from pathlib import Path

from specdoctor.errors import SpecdoctorError
from specdoctor.report import Finding
from specdoctor.runtime.engine import Engine

DEFAULT_MIN_ACCEPTANCE_LENGTH = 1.4  # broken drafters measure 1.00-1.14 on the demo, healthy ones >= 1.8


def load_battery(path: Path | None) -> list[dict]:
    """The built-in 9-prompt battery, or a user's: one JSON object per line with a "prompt"."""
    if path is None:
        lines = resources.files("specdoctor").joinpath("battery.jsonl").read_text(encoding="utf-8").splitlines()
        source = "built-in battery"
    else:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise SpecdoctorError(f"{path}: cannot read battery ({err.strerror})") from None
        source = str(path)
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            raise SpecdoctorError(f"{source}:{number}: not valid JSON") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
            raise SpecdoctorError(f'{source}:{number}: expected an object with a non-empty "prompt" string')
        entries.append({"name": str(entry.get("name", f"prompt-{number}")), "prompt": entry["prompt"]})
    if not entries:
        raise SpecdoctorError(f"{source}: no prompts")
    return entries


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
    engine: Engine,
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
    profile = proposal_profile(result.proposals)
    return {
        "battery": f"{sum(lossless)}/{len(lossless)}",
        "lossless": lossless,
        "metrics": metrics,
        "proposals": profile,
        "findings": behaviour_findings(lossless, metrics, profile, k, min_length, stage),
    }


def behaviour_findings(lossless, metrics, profile, k, min_length, stage) -> list[Finding]:
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
    if mean < min_length:
        collapsed = mean < 1.05 and rates and rates[0] < 0.05
        findings.append(
            Finding(
                "behaviour.acceptance",
                "error",
                f"{summary}: below {min_length}" + (": the drafter is broken" if collapsed else ""),
                "an uninitialised or aliased drafter embedding, or missing drafter weights, gives about 1.00"
                if collapsed
                else "a healthy MTP drafter accepts most position-0 drafts (DeepSeek-V3 k=1: 85-90 %)",
                stage,
            )
        )
    else:
        findings.append(Finding("behaviour.acceptance", "info", summary, stage=stage))
    if k >= 2 and rates[0] >= 0.3 and rates[1] < 0.25 * rates[0]:
        findings.append(
            Finding(
                "behaviour.chain",
                "warning",
                f"acceptance drops from {rates[0]:.0%} at position 0 to {rates[1]:.0%} at position 1",
                "the multi-step chain is fed the wrong hidden state or norm",
                stage,
            )
        )
    if profile["count"] >= 20 and profile["top_share"] >= 0.5:
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
