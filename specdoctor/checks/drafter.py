"""Findings about the loaded drafter, from what its rank measured (runtime/drafter/measure.py).

Statistics are compared with the checkpoint (sampled rows read from it), so a mismatch is found
whatever the memory held: zeros, NaN, stale bytes of another tensor, or a half-written table.
"""

from __future__ import annotations

from specdoctor.report import Finding
from specdoctor.runtime.drafter.measure import DrafterState, TensorRecord


def drafter_findings(state: DrafterState, stage: str) -> tuple[list[Finding], dict[int, list[str]]]:
    """(findings, names of the broken drafter tensors by TP rank) for a DrafterState. Under TP each rank's shard
    was measured on its rank: its findings name the rank (the others may be healthy)."""
    if not state.tp_ranks:
        findings, broken = shard_findings(state, stage)
        return findings, {0: broken}
    findings, broken = [], {}
    for shard in state.tp_ranks:
        found, broken[shard.tp_rank] = shard_findings(shard, stage)
        label = f"TP rank {shard.tp_rank}/{len(state.tp_ranks)}"
        for finding in found:
            if finding.severity != "info" or shard.tp_rank == 0:
                finding.message = f"{label}: {finding.message}"
                finding.data = {**(finding.data or {}), "tp_rank": shard.tp_rank}
                findings.append(finding)
    return findings, broken


def shard_findings(state: DrafterState, stage: str) -> tuple[list[Finding], list[str]]:
    """(findings, names of the broken drafter tensors) for one rank's DrafterState."""
    findings = [provenance_finding(state.unfilled, stage)]
    for name, placeholder in state.placeholders.items():
        findings.append(
            Finding(
                "drafter.alias",
                "error",
                f"drafter {name} is a {placeholder.module_type} with no weight"
                + (" that returns its input (token ids)" if placeholder.echoes_ids else ""),
                "it aliases a placeholder for a module this rank does not own; load the tensor instead",
                stage,
                {"name": name},
            )
        )
    for name, record in state.tensors.items():
        findings += tensor_findings(name, record, stage)
    broken = set(state.unfilled) | {f.data["name"] for f in findings if f.severity == "error" and "name" in f.data}
    return findings, sorted(broken)


def provenance_finding(unfilled: list[str], stage: str) -> Finding:
    if not unfilled:
        return Finding("drafter.provenance", "info", "every drafter tensor was loaded or aliased", stage=stage)
    return Finding(
        "drafter.provenance",
        "error",
        f"{len(unfilled)} drafter tensor(s) neither loaded nor aliased to a real tensor: {', '.join(unfilled)}",
        "load them from the target checkpoint (specdoctor check --repair)",
        stage,
        {"unfilled": unfilled},
    )


# An embedding or head whose rows are (nearly) all zero or all the same proposes one token whatever the
# context (a Markov table adds the same bias after every token): true of any model, with or without the
# checkpoint to compare against.
DEGENERATE_FRACTION = 0.99
TABLES = ("embed_tokens.weight", "shared_head.head.weight", "lm_head.weight", "markov_w1.weight", "markov_w2.weight")


def tensor_findings(name: str, record: TensorRecord, stage: str) -> list[Finding]:
    findings = []
    stats = {**record.to_dict(), "name": name}  # each finding's data
    summary = (
        f"NaN {record.nan}, Inf {record.inf}, zeros {record.zero_fraction:.0%}, "
        f"mean {record.mean:.3g}, std {record.std:.3g}, absmax {record.absmax:.3g}"
        if record.measured
        else f"{record.numel:,} values"
    )
    if record.nan or record.inf:
        findings.append(
            Finding(
                "drafter.stats",
                "error",
                f"drafter {name} holds non-finite values ({summary})",
                "the tensor was never loaded; repair it from the checkpoint",
                stage,
                stats,
            )
        )
    elif degenerate(name, record):
        findings.append(
            Finding(
                "drafter.stats",
                "error",
                f"drafter {name}: {degenerate(name, record)} ({summary})",
                "a table whose rows are all zero or all equal was never loaded; repair it from the checkpoint",
                stage,
                stats,
            )
        )
    if record.checkpoint_shape is not None:
        findings.append(
            Finding(
                "drafter.fingerprint",
                "error",
                f"drafter {name} has shape {tuple(record.shape)}, not {record.checkpoint_key}'s "
                f"{tuple(record.checkpoint_shape)}: another tensor is in its place",
                "the engine put another tensor (the target's head over a pruned draft head?) where the checkpoint's "
                "belongs; repair it",
                stage,
                stats,
            )
        )
    if record.mismatched_rows:
        findings.append(
            Finding(
                "drafter.fingerprint",
                "error",
                f"drafter {name}: {record.mismatched_rows}/{record.compared_rows} sampled rows differ from "
                f"{record.checkpoint_key} ({summary})",
                "the memory holds something other than the checkpoint's tensor; repair it",
                stage,
                stats,
            )
        )
    if name.endswith("norm.weight") and record.measured and abs(record.mean) < 0.1:
        findings.append(
            Finding(
                "drafter.norms",
                "warning",
                f"drafter {name} has mean {record.mean:.3g}",
                "RMSNorm weights stored zero-centred need +1 before use",
                stage,
                stats,
            )
        )
    return findings


def degenerate(name: str, record: TensorRecord) -> str | None:
    """Why an embedding or head table cannot be a trained one, or None."""
    if not name.endswith(TABLES):
        return None
    if (record.zero_fraction or 0.0) >= DEGENERATE_FRACTION:
        return f"{record.zero_fraction:.0%} of its values are zero"
    if (record.duplicate_row_fraction or 0.0) >= DEGENERATE_FRACTION:
        return f"{record.duplicate_row_fraction:.0%} of its rows repeat another row"
    return None
