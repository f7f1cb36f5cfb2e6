"""Pre-flight findings about the target's own MTP layers (the MTP drafter kind), from the headers alone:
every tensor an MTP layer needs, and where the drafter's embedding comes from on its rank."""

from __future__ import annotations

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
