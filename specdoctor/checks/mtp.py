"""Pre-flight findings about the target's own MTP layers (the MTP drafter kind), from the headers alone:
every tensor an MTP layer needs, where the drafter's embedding comes from on its rank, and how the layers are
stored beside a quantised target; with sampled rows, their own copies (own_copies.py)."""

from __future__ import annotations

from collections import Counter

from specdoctor.checks.kind_checks import KindChecks
from specdoctor.checks.own_copies import own_copy_findings
from specdoctor.checks.quantization import quantization, target_formats
from specdoctor.report import Finding
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.mtp import (
    MtpKind,
    drafter_embedding_key,
    embedding_candidates,
    expected_mtp_keys,
    own_embedding_keys,
    own_head_key,
)
from specdoctor.runtime.partition import Placement
from specdoctor.runtime.quantization import ignored_by_config

FLOAT_DTYPES = {"F32", "BF16", "F16"}


def mtp_tensors(checkpoint: Checkpoint) -> list[Finding]:
    shared = [key for key in checkpoint.config.mtp_keys.shared_keys if key not in checkpoint.tensors]
    findings = []
    if checkpoint.config.num_nextn_predict_layers and shared:
        findings.append(
            Finding(
                "mtp.tensors",
                "error",
                f"the MTP drafter lacks {len(shared)} shared tensor(s), first {shared[0]}",
                "a quantisation ignore list or export may have dropped them",
                data={"missing": shared},
            )
        )
    for layer_id in checkpoint.config.mtp_layer_ids:
        expected = expected_mtp_keys(checkpoint.config, layer_id)
        missing = [k for k in expected if k not in checkpoint.tensors]
        head = own_head_key(checkpoint.config, layer_id)
        if head in missing:
            missing.remove(head)
            findings.append(
                Finding(
                    "mtp.shared_head",
                    "warning",
                    f"{head} is not in the checkpoint",
                    "loaders that keep only spec-layer keys leave the draft head unloaded; it must come from lm_head",
                )
            )
        if missing:
            findings.append(
                Finding(
                    "mtp.tensors",
                    "error",
                    f"MTP layer {layer_id} lacks {len(missing)} tensor(s), first {missing[0]}",
                    "a quantisation ignore list or export may have dropped them",
                    data={"missing": missing},
                )
            )
        else:
            findings.append(
                Finding("mtp.tensors", "info", f"MTP layer {layer_id}: all {len(expected)} tensors present")
            )
    return findings


def embedding_source(checkpoint: Checkpoint, ranks: list[Placement]) -> list[Finding]:
    candidates = embedding_candidates(checkpoint.config)
    key = drafter_embedding_key(checkpoint)
    if key is None:
        return [
            Finding(
                "embedding.source",
                "error",
                "no candidate key can supply the drafter's embedding",
                "extend the candidate list for this layout",
                data={"candidates": candidates},
            )
        ]
    info = checkpoint.tensors[key]
    findings = [
        Finding(
            "embedding.source",
            "info",
            f"drafter embedding source: {key} ({info.dtype}, {info.shape}, {info.shard})",
            data={"key": key},
        )
    ]
    if info.dtype not in FLOAT_DTYPES:
        findings.append(
            Finding(
                "embedding.dtype",
                "warning",
                f"{key} is stored as {info.dtype}",
                "a quantised embedding needs dequantising before the drafter can use it",
            )
        )
    drafter_rank = ranks[-1]
    own_copy = checkpoint.first_present(own_embedding_keys(checkpoint.config)) is not None
    if not drafter_rank.has_embedding and not own_copy:
        findings.append(
            Finding(
                "placement.drafter_embedding",
                "warning",
                f"the drafter runs on rank {drafter_rank.rank} with no local embedding, "
                "and the checkpoint has no MTP copy",
                "unpatched engines leave the drafter's embedding uninitialised here; load it from the checkpoint "
                "(specdoctor check --repair)",
            )
        )
    return findings


def mtp_preflight(drafter: MtpKind, ranks: list[Placement]) -> list[Finding]:
    return mtp_tensors(drafter.target) + embedding_source(drafter.target, ranks)


# Float weights the formats leave unquantised by design (embeddings, heads, norms, the MoE router).
NEVER_QUANTISED = ("embed_tokens", "lm_head", "shared_head.head", "norm", "mlp.gate.", "e_score_correction_bias")


def mtp_quantization(drafter: MtpKind) -> list[Finding]:
    """The target's quantisation, its MTP layers apart: each stored as the target is, or exempt."""
    checkpoint = drafter.target
    layers = {i: expected_mtp_keys(checkpoint.config, i) for i in checkpoint.config.mtp_layer_ids}
    keys = frozenset(key for layer in layers.values() for key in layer)
    findings = quantization(checkpoint, keys)
    if not findings:  # not quantised
        return []
    config, target = checkpoint.raw_config.get("quantization_config") or {}, target_formats(checkpoint, keys)
    return findings + [
        finding for i, layer in layers.items() if (finding := mtp_scheme(checkpoint, config, i, layer, target))
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


CHECKS = KindChecks(
    MtpKind, mtp_preflight, quantization=mtp_quantization, sampled=lambda drafter: own_copy_findings(drafter.target)
)
