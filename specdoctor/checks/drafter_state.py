"""Checks on the loaded drafter, and its repair. Both run on the drafter's rank, where it lives.

Statistics are compared with the checkpoint (sampled rows read from it), so a mismatch is found
whatever the memory held: zeros, NaN, stale bytes of another tensor, or a half-written table.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from specdoctor import kernels
from specdoctor.report import Finding
from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.decode import RankModel
from specdoctor.runtime.drafter_loading import has_real_weight, read_vocab_shard, vocab_shard_range
from specdoctor.runtime.loader import drafter_layer_key, embedding_candidates, load_module, target_embedding_key

SAMPLED_ROWS = 64
EMBEDDING = "embed_tokens.weight"


def expected_key(checkpoint: Checkpoint, name: str) -> str | None:
    """The checkpoint key a drafter parameter should equal."""
    if name == EMBEDDING:
        return checkpoint.first_present(embedding_candidates(checkpoint.config))
    key = drafter_layer_key(name)
    if key in checkpoint.tensors:
        return key
    if name.endswith("shared_head.head.weight"):
        return "lm_head.weight" if "lm_head.weight" in checkpoint.tensors else target_embedding_key(checkpoint)
    return None


def tensor_stats(tensor: torch.Tensor) -> dict:
    """NaN/Inf counts, zero fraction, and moments of the finite values (one pass through the kernels);
    duplicate rows for matrices, from per-row fingerprints."""
    raw = kernels.tensor_stats(tensor)
    numel = tensor.numel()
    finite = numel - raw["nan"] - raw["posinf"] - raw["neginf"]
    mean = raw["sum"] / finite if finite else float("nan")
    variance = (raw["sumsq"] / finite - mean * mean) * finite / (finite - 1) if finite > 1 else float("nan")
    stats = {
        "numel": numel,
        "nan": raw["nan"],
        "inf": raw["posinf"] + raw["neginf"],
        "zero_fraction": raw["zeros"] / numel if numel else 0.0,
        "mean": mean,
        "std": math.sqrt(max(variance, 0.0)) if finite > 1 else float("nan"),
        "absmax": raw["absmax"] if finite else float("nan"),
    }
    if tensor.dim() == 2 and tensor.shape[0] > 1:
        # Equal rows (e.g. an all-zero table) share a fingerprint: a projection on a fixed random direction.
        projection = torch.randn(tensor.shape[1], generator=torch.Generator().manual_seed(0)).to(tensor.device)
        rows = torch.arange(tensor.shape[0], device=tensor.device)
        _, fingerprints = kernels.row_fingerprints(tensor.detach(), rows, projection)
        stats["duplicate_row_fraction"] = 1.0 - fingerprints.unique().numel() / tensor.shape[0]
    return stats


def fingerprint_mismatch(checkpoint: Checkpoint, key: str, loaded: torch.Tensor) -> tuple[int, int]:
    """(mismatching, compared) rows between the loaded tensor and rows read from the checkpoint."""
    if loaded.dim() == 1:
        expected = checkpoint.read(key).to(loaded.dtype)
        return int(not torch.equal(loaded.detach().cpu(), expected)), 1
    count = loaded.shape[0]
    rows = sorted({int(r) for r in torch.linspace(0, count - 1, min(SAMPLED_ROWS, count))})
    mismatches = 0
    for row in rows:
        expected = checkpoint.read(key, rows=(row, row + 1)).to(loaded.dtype)
        mismatches += int(not torch.equal(loaded[row : row + 1].detach().cpu(), expected))
    return mismatches, len(rows)


def drafter_parameters(model: RankModel) -> dict[str, nn.Module | torch.Tensor]:
    """The drafter tensors worth comparing: embedding, heads, input projection and norms."""
    drafter = model.drafter
    out: dict = {EMBEDDING: drafter.embed_tokens}
    for layer_id, layer in drafter.layers.items():
        prefix = f"layers.{layer_id}."
        out[prefix + "shared_head.head.weight"] = layer.shared_head.head
        for part in ("eh_proj", "enorm", "hnorm", "shared_head.norm"):
            out[f"{prefix}{part}.weight"] = layer.get_submodule(part)
    return out


def inspect_drafter(model: RankModel, stage: str) -> dict:
    checkpoint, provenance = model.checkpoint, model.provenance
    findings: list[Finding] = []
    unfilled = [name for name, source in provenance.items() if source.startswith(("unfilled", "placeholder"))]
    if unfilled:
        findings.append(
            Finding(
                "drafter.provenance",
                "error",
                f"{len(unfilled)} drafter tensor(s) neither loaded nor aliased to a real tensor: {', '.join(unfilled)}",
                "load them from the target checkpoint (specdoctor check --repair)",
                stage,
                {"unfilled": unfilled},
            )
        )
    else:
        findings.append(
            Finding("drafter.provenance", "info", "every drafter tensor was loaded or aliased", stage=stage)
        )
    tensors = {}
    for name, module in drafter_parameters(model).items():
        if not has_real_weight(module):
            output = module(torch.arange(3, device=model.stage.lm_head.weight.device)[None])
            echoed = isinstance(output, torch.Tensor) and not output.is_floating_point()
            findings.append(
                Finding(
                    "drafter.alias",
                    "error",
                    f"drafter {name} is a {type(module).__name__} with no weight"
                    + (" that returns its input (token ids)" if echoed else ""),
                    "it aliases a placeholder for a module this rank does not own; load the tensor instead",
                    stage,
                    {"name": name},
                )
            )
            continue
        weight = module.weight
        key = expected_key(checkpoint, name)
        stats = tensor_stats(weight)
        if key is not None:
            stats["mismatched_rows"], stats["compared_rows"] = fingerprint_mismatch(checkpoint, key, weight)
            stats["checkpoint_key"] = key
        tensors[name] = stats
        findings += tensor_findings(name, stats, stage)
    broken = set(unfilled) | {f.data.get("name") for f in findings if f.severity == "error" and f.data.get("name")}
    return {"findings": findings, "tensors": tensors, "provenance": dict(provenance), "broken": sorted(broken)}


def tensor_findings(name: str, stats: dict, stage: str) -> list[Finding]:
    findings = []
    stats = {**stats, "name": name}
    summary = (
        f"NaN {stats['nan']}, Inf {stats['inf']}, zeros {stats['zero_fraction']:.0%}, "
        f"mean {stats['mean']:.3g}, std {stats['std']:.3g}, absmax {stats['absmax']:.3g}"
    )
    if stats["nan"] or stats["inf"]:
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
    if stats.get("mismatched_rows"):
        findings.append(
            Finding(
                "drafter.fingerprint",
                "error",
                f"drafter {name}: {stats['mismatched_rows']}/{stats['compared_rows']} sampled rows differ from "
                f"{stats['checkpoint_key']} ({summary})",
                "the memory holds something other than the checkpoint's tensor; repair it",
                stage,
                stats,
            )
        )
    if name.endswith("norm.weight") and abs(stats["mean"]) < 0.1:
        findings.append(
            Finding(
                "drafter.norms",
                "warning",
                f"drafter {name} has mean {stats['mean']:.3g}",
                "RMSNorm weights stored zero-centred need +1 before use",
                stage,
                stats,
            )
        )
    return findings


def repair_drafter(model: RankModel, names: list[str], tp_size: int = 1, tp_rank: int = 0) -> dict:
    """Fill the named drafter tensors from the target checkpoint, reading one tensor at a time."""
    checkpoint, drafter, provenance = model.checkpoint, model.drafter, model.provenance
    device, dtype = model.stage.lm_head.weight.device, model.stage.lm_head.weight.dtype
    before, start = checkpoint.bytes_read, time.perf_counter()
    repaired, shard = {}, None
    for name in names:
        key = expected_key(checkpoint, name)
        if key is None:
            continue
        if name == EMBEDDING:
            # The runtime computes with the whole vocabulary: TP rank 0 of 1 is the whole padded table.
            table = read_vocab_shard(checkpoint, key, 1, 0)[: checkpoint.config.vocab_size]
            drafter.embed_tokens = nn.Embedding.from_pretrained(table.to(device, dtype), freeze=True)
            if tp_size > 1:
                shard = check_vocab_shard(checkpoint, key, table, tp_size, tp_rank)
        else:
            module = drafter.get_submodule(name.removesuffix(".weight"))
            load_module(module, checkpoint, lambda _n, key=key: key)
        provenance[name] = f"checkpoint:{key}"
        repaired[name] = key
    return {
        "repaired": repaired,
        "bytes_read": checkpoint.bytes_read - before,
        "seconds": round(time.perf_counter() - start, 4),
        "tp_shard": shard,
    }


def check_vocab_shard(checkpoint: Checkpoint, key: str, table: torch.Tensor, tp_size: int, tp_rank: int) -> dict:
    """What a TP rank's vocab shard of the repair would hold: its rows of the table, padded rows zero."""
    start, end = vocab_shard_range(table.shape[0], tp_size, tp_rank)
    shard = read_vocab_shard(checkpoint, key, tp_size, tp_rank)
    real = max(0, min(end, table.shape[0]) - start)
    return {
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "rows": [start, end],
        "real_rows": real,
        "padded_rows": shard.shape[0] - real,
        "matches_table": bool(torch.equal(shard[:real], table[start : start + real].to(shard.dtype))),
        "padding_zero": bool((shard[real:] == 0).all()),
    }
