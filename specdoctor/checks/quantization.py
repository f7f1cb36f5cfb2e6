"""Pre-flight on quantised checkpoints, from config.json and the headers alone: the scheme, which weights
it covers, and the hazards (docs/quantization.md §Hazards)."""

from __future__ import annotations

from collections import Counter

from specdoctor.report import Finding
from specdoctor.runtime.checkpoint.keys import TARGET_HEAD, target_embedding_key
from specdoctor.runtime.checkpoint.reader import Checkpoint


def target_formats(checkpoint: Checkpoint, drafter_keys: frozenset[str] = frozenset()) -> Counter:
    """How many of the target's own weights (`drafter_keys` aside) are stored quantised, by format."""
    return Counter(w.format for key, w in checkpoint.quantized.items() if key not in drafter_keys)


def quantization(checkpoint: Checkpoint, drafter_keys: frozenset[str] = frozenset()) -> list[Finding]:
    """`drafter_keys`: a drafter's tensors kept in this checkpoint (its kind's checks say which): not counted as
    the target's, their embeddings and heads held to the floating-point rule too."""
    if not checkpoint.quantization and not checkpoint.quantized:
        return []
    config = checkpoint.raw_config.get("quantization_config") or {}
    target = target_formats(checkpoint, drafter_keys)
    covered = ", ".join(f"{count} {form}" for form, count in sorted(target.items())) or "none"
    findings = [
        Finding(
            "quantization",
            "info",
            f"weights are quantised: {checkpoint.quantization}; target weights stored quantised: {covered}",
            data={"quantization_config": config, "target_formats": dict(target)},
        )
    ]
    findings += [
        Finding("quantization.unreadable", "error", problem, "the runtime will not run these weights")
        for problem in checkpoint.quantization_problems
    ]
    if config and not checkpoint.quantized and not checkpoint.quantization_problems:
        findings.append(
            Finding(
                "quantization.config",
                "warning",
                "quantization_config is set but no tensor is stored quantised",
                "an engine would build quantised layers and find no packed weights or scales to load into them",
            )
        )
    heads = {target_embedding_key(checkpoint), TARGET_HEAD} | {k for k in drafter_keys if "head" in k or "embed" in k}
    return findings + [
        Finding(
            "quantization.embedding",
            "warning",
            f"{key} is stored quantised ({checkpoint.quantized[key].format})",
            "the formats keep embeddings and heads in floating point; engines read them as plain tensors",
        )
        for key in sorted(heads & checkpoint.quantized.keys())
    ]
