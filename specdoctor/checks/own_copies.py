"""How an MTP layer's own copy of the embedding or head relates to the target's tensor.

A checkpoint may ship `model.layers.{N}.embed_tokens` and `…shared_head.head` beside the target's
tensors. Identical copies are fine (DeepSeek-V3 ships its embedding that way); a copy whose rows are
the target's, shifted or permuted, is a broken re-export (an error); a different tensor is a warning
(some models train their own MTP head, e.g. Step-3.5-Flash, where overwriting it cost acceptance
97 % -> 4 %). Reads sampled rows of both; the whole target tensor only when the sampled rows differ.
"""

from __future__ import annotations

import torch

from specdoctor.report import Finding
from specdoctor.runtime.checkpoint.keys import target_embedding_key, target_head_key
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.mtp import own_embedding_key, own_head_key

SAMPLED_ROWS = 64
CHUNK_ROWS = 4096  # rows of the target read at a time when looking for where a copy's rows came from


def own_copy_findings(checkpoint: Checkpoint) -> list[Finding]:
    findings = []
    for layer_id in checkpoint.config.mtp_layer_ids:
        pairs = (
            (own_embedding_key(checkpoint.config, layer_id), target_embedding_key(checkpoint)),
            (own_head_key(checkpoint.config, layer_id), target_head_key(checkpoint)),
        )
        for own, target in pairs:
            if own in checkpoint.tensors and target in checkpoint.tensors:
                findings.append(relation_finding(checkpoint, own, target))
    return findings


def relation_finding(checkpoint: Checkpoint, own: str, target: str) -> Finding:
    severity, relation = compare_copy(checkpoint, own, target)
    hints = {
        "info": "",
        "error": "a broken re-export: the copy's rows are the target's in another order; re-export the MTP layer",
        "warning": "the MTP layer was trained with its own tensor: engines must load it, not the target's",
    }
    return Finding("checkpoint.own_copy", severity, f"{own} {relation} {target}", hints[severity], "preflight")


def sampled_rows(count: int) -> list[int]:
    return sorted({int(r) for r in torch.linspace(0, count - 1, min(SAMPLED_ROWS, count))})


def compare_copy(checkpoint: Checkpoint, own: str, target: str) -> tuple[str, str]:
    """(severity, relation) of an own copy to the target tensor, from sampled rows."""
    own_info, target_info = checkpoint.tensors[own], checkpoint.tensors[target]
    if own_info.shape != target_info.shape:
        return "error", f"has shape {own_info.shape}, unlike {target_info.shape} of"
    rows = sampled_rows(own_info.shape[0])
    copy = torch.cat([checkpoint.read(own, rows=(r, r + 1)) for r in rows]).float()
    if all(torch.equal(copy[i : i + 1], checkpoint.read(target, rows=(r, r + 1)).float()) for i, r in enumerate(rows)):
        return "info", f"is identical (on {len(rows)} sampled rows) to"
    sources = locate_rows(checkpoint, target, copy)
    found = [source for source in sources if source is not None]
    if len(found) < len(rows):
        return "warning", f"differs from (on {len(rows) - len(found)} of {len(rows)} sampled rows)"
    count = own_info.shape[0]
    shifts = {(source - row) % count for source, row in zip(found, rows, strict=True)}  # a roll wraps around
    if len(shifts) == 1:
        shift = shifts.pop()
        return "error", f"holds the rows, shifted by {shift - count if shift > count // 2 else shift}, of"
    return "error", "holds the rows, permuted, of"


def locate_rows(checkpoint: Checkpoint, key: str, rows: torch.Tensor) -> list[int | None]:
    """For each row [S, H], the index of an identical row of the tensor `key`, or None."""
    projection = torch.randn(rows.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    wanted = {float(fingerprint): i for i, fingerprint in enumerate(rows.double() @ projection)}
    found: list[int | None] = [None] * rows.shape[0]
    total = checkpoint.tensors[key].shape[0]
    for start in range(0, total, CHUNK_ROWS):
        chunk = checkpoint.read(key, rows=(start, min(total, start + CHUNK_ROWS))).double()
        for offset, fingerprint in enumerate((chunk @ projection).tolist()):
            index = wanted.get(fingerprint)
            if index is not None and found[index] is None and torch.equal(chunk[offset], rows[index].double()):
                found[index] = start + offset
    return found
