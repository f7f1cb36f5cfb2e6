"""Pre-flight on quantised checkpoints, from config.json and the headers alone: the scheme, which weights
it covers, and the hazards (docs/quantization.md §Hazards)."""

from __future__ import annotations

from collections import Counter

from specdoctor.report import Finding
from specdoctor.runtime.checkpoint.keys import TARGET_HEAD, target_embedding_key
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.mtp import expected_mtp_keys
from specdoctor.runtime.quantization import ignored_by_config

# Float weights the formats leave unquantised by design (embeddings, heads, norms, the MoE router).
NEVER_QUANTISED = ("embed_tokens", "lm_head", "shared_head.head", "norm", "mlp.gate.", "e_score_correction_bias")


def quantization(checkpoint: Checkpoint) -> list[Finding]:
    if not checkpoint.quantization and not checkpoint.quantized:
        return []
    config = checkpoint.raw_config.get("quantization_config") or {}
    mtp = {i: expected_mtp_keys(checkpoint.config, i) for i in checkpoint.config.mtp_layer_ids}
    mtp_keys = {key for keys in mtp.values() for key in keys}
    target = Counter(w.format for key, w in checkpoint.quantized.items() if key not in mtp_keys)
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
    heads = {target_embedding_key(checkpoint), TARGET_HEAD} | {k for k in mtp_keys if "head" in k or "embed" in k}
    findings += [
        Finding(
            "quantization.embedding",
            "warning",
            f"{key} is stored quantised ({checkpoint.quantized[key].format})",
            "the formats keep embeddings and heads in floating point; engines read them as plain tensors",
        )
        for key in sorted(heads & checkpoint.quantized.keys())
    ]
    return findings + [
        finding for i, keys in mtp.items() if (finding := mtp_scheme(checkpoint, config, i, keys, target))
    ]


def mtp_scheme(checkpoint: Checkpoint, config: dict, layer_id: int, keys: list[str], target: Counter) -> Finding | None:
    """An MTP layer stored differently from the target: a hazard when the config would quantise it anyway."""
    formats = Counter(checkpoint.quantized[key].format for key in keys if key in checkpoint.quantized)
    if set(formats) == set(target):
        return None
    plain = [
        key for key in keys
        if key not in checkpoint.quantized and key.endswith(".weight") and not any(p in key for p in NEVER_QUANTISED)
        and key in checkpoint.tensors and len(checkpoint.tensors[key].shape) == 2
    ]  # fmt: skip
    expected_quantised = [key for key in plain if not ignored_by_config(config, key.removesuffix(".weight"))]
    stored = ", ".join(sorted(formats)) or "floating point"
    message = (
        f"MTP layer {layer_id} is stored as {stored}, the target as {', '.join(sorted(target)) or 'floating point'}"
    )
    if expected_quantised:
        return Finding(
            "quantization.mtp",
            "warning",
            f"{message}, and quantization_config does not exempt it (e.g. {expected_quantised[0]})",
            "engines apply quantization_config to the MTP layer: add it to the ignore list or quantise it",
            data={"not_exempt": expected_quantised},
        )
    return Finding("quantization.mtp", "info", f"{message} (exempt in quantization_config)")
