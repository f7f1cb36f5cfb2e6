"""`specdoctor inspect`: what a checkpoint holds, from its headers alone."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdoctor.commands.options import JsonReportOption, ModelOption, runtime_field_option
from specdoctor.commands.output import emit_json_or_table
from specdoctor.report import Finding, findings_table, placement_table

PipelineSizeOption = runtime_field_option("pp")
TensorParallelOption = runtime_field_option("tp")
SpeculativeModelOption = runtime_field_option("speculative_model")
CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_nextn_predict_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "tie_word_embeddings",
)


def inspect(
    model: ModelOption,
    pp: PipelineSizeOption = 1,
    tp: TensorParallelOption = 1,
    speculative_model: SpeculativeModelOption = None,
    json_out: JsonReportOption = None,
) -> None:
    """Describe a checkpoint from its headers alone, for any architecture whose MTP layout is known: sizes,
    keys, where the drafter's tensors live (a DSpark drafter's too), the placement at --tp x --pp ranks and the
    pre-flight's findings."""
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import drafter_kind

    checkpoint = Checkpoint(model)
    summary = summarize(checkpoint, pp, drafter_kind(checkpoint, model, speculative_model), tp)
    emit_json_or_table(json.dumps(summary, indent=2) + "\n", json_out, lambda console: render_summary(summary, console))


def describe(info) -> dict | None:
    """A TensorInfo as JSON, or None for an absent tensor."""
    if info is None:
        return None
    return {"key": info.key, "shard": info.shard, "dtype": info.dtype, "shape": list(info.shape), "bytes": info.nbytes}


def summarize(checkpoint, pp: int = 1, drafter=None, tp: int = 1) -> dict:
    """`drafter`: the kind of drafter that drafts for this target (runtime/drafter/kinds.py), or None."""
    from dataclasses import asdict

    from specdoctor.checks.preflight import preflight
    from specdoctor.runtime.architectures import ARCHITECTURES
    from specdoctor.runtime.checkpoint.keys import TARGET_HEAD, target_embedding_key
    from specdoctor.runtime.drafter.mtp import drafter_embedding_key, embedding_candidates, expected_mtp_keys
    from specdoctor.runtime.partition import placements
    from specdoctor.workflow.check import placement_row

    config, tensors = checkpoint.config, checkpoint.tensors
    layout = config.mtp_keys
    mtp_layers = []
    for layer_id in config.mtp_layer_ids:
        prefix = layout.prefix(layer_id)
        present = sorted(k for k in tensors if k.startswith(prefix))
        expected = expected_mtp_keys(config, layer_id)
        mtp_layers.append(
            {
                "layer": layer_id,
                "prefix": prefix,
                "tensors": [describe(tensors[k]) for k in present],
                "missing": [k for k in expected if k not in tensors],
            }
        )
    ranks = placements(config, pp, has_drafter=drafter is not None)
    return {
        "path": str(checkpoint.path),
        "layout": checkpoint.layout,
        "architecture": config.architecture,
        "runtime": checkpoint.unrunnable_reason() or "runs",
        "mtp_layout": layout.name,
        "vllm_drafter": ARCHITECTURES[config.architecture].vllm_drafter,
        "quantization": checkpoint.quantization,
        "config": {name: getattr(config, name) for name in CONFIG_FIELDS},
        "num_keys": len(tensors),
        "num_shards": len({t.shard for t in tensors.values()}),
        "total_bytes": sum(t.nbytes for t in tensors.values()),
        "dtypes": dict(Counter(t.dtype for t in tensors.values()).most_common()),
        "embedding": describe(tensors.get(target_embedding_key(checkpoint))),
        "lm_head": describe(tensors.get(TARGET_HEAD)),
        "mtp_shared_tensors": {key: describe(tensors.get(key)) for key in layout.shared_keys},
        "mtp_layers": mtp_layers,
        "mtp_layer_keys": [*layout.layer_keys, *(k for k in (layout.own_embedding, layout.own_head) if k)],
        "draft_embedding": {"key": drafter_embedding_key(checkpoint), "candidates": embedding_candidates(config)},
        "block_drafter": own_checkpoint_summary(drafter),  # the schema's name for a drafter checkpoint of its own
        "placement": [placement_row(rank, tp) for rank in ranks],
        "preflight": [asdict(finding) for finding in preflight(checkpoint, ranks, drafter) + tp_findings(config, tp)],
    }


def tp_findings(config, tp: int) -> list:
    """At --tp > 1, what vLLM refuses of this model's split (check and every runtime command refuse it too)."""
    from specdoctor.errors import SpecdoctorError
    from specdoctor.report import Finding
    from specdoctor.runtime.tensor_parallel import refusal

    if tp < 1:
        raise SpecdoctorError(f"--tensor-parallel-size must be at least 1, got {tp}")
    reason = refusal(config, tp)
    hint = "choose a TP size the heads, KV heads, intermediate sizes and padded vocabulary divide by"
    return [Finding("placement.tensor_parallel", "error", f"TP {tp}: {reason}", hint, "preflight")] if reason else []


def own_checkpoint_summary(drafter) -> dict | None:
    """A drafter that is a checkpoint of its own: its path, what its kind says of its config, its tensors."""
    own = drafter.checkpoint if drafter else None
    if own is None:
        return None
    tensors = [describe(info) for _, info in sorted(own.tensors.items())]
    return {"path": str(own.path), **drafter.config_summary(), "label": drafter.label, "tensors": tensors}


def render_summary(summary: dict, console: Console) -> None:
    overview = Table(title=f"{summary['path']}", show_header=False)
    for label, key in (("architecture", "architecture"), ("runtime", "runtime"), ("MTP layout", "mtp_layout")):
        overview.add_row(label, summary[key])
    overview.add_row("vLLM 0.32 drafter", summary["vllm_drafter"])
    overview.add_row("quantization", summary["quantization"] or "none (floating-point weights)")
    overview.add_row("layout", summary["layout"])
    for name, value in summary["config"].items():
        overview.add_row(name, str(value))
    overview.add_row("tensors", f"{summary['num_keys']:,} in {summary['num_shards']} shard(s)")
    overview.add_row("total bytes", f"{summary['total_bytes']:,} ({summary['total_bytes'] / 2**20:.1f} MiB)")
    overview.add_row("dtypes", ", ".join(f"{d}: {n}" for d, n in summary["dtypes"].items()))
    console.print(overview)
    console.print(drafter_table(summary))
    draft = summary["draft_embedding"]["key"]
    if draft:
        console.print(f"Draft embedding source: [bold]{draft}[/bold] (first present of the candidate keys)")
    else:
        console.print("[red]Draft embedding source: none of the candidate keys is in the checkpoint[/red]")
    console.print(placement_table(summary["placement"]))
    findings = [Finding(**finding) for finding in summary["preflight"]]
    console.print(findings_table("Pre-flight (headers only)", findings))


def drafter_table(summary: dict) -> Table:
    where = Table(title="Where the drafter's tensors live")
    for column in ("tensor", "key", "shard", "dtype", "shape"):
        where.add_column(column, overflow="fold")

    def row(label: str, info: dict | None, key: str = "") -> None:
        shape = str(tuple(info["shape"])) if info else ""
        where.add_row(
            label,
            info["key"] if info else key or "absent",
            info["shard"] if info else "",
            info["dtype"] if info else "",
            shape,
        )

    row("embedding", summary["embedding"])
    row("lm_head", summary["lm_head"])
    for key, info in summary["mtp_shared_tensors"].items():
        row("MTP (shared)", info, f"{key} [red]missing[/red]")
    own = summary["block_drafter"]
    for info in own["tensors"] if own else []:
        row(f"{own['label'].split()[0]} {Path(own['path']).name}", info)
    for layer in summary["mtp_layers"]:
        label = f"MTP {layer['layer']}"
        for info in layer["tensors"]:
            if info["key"].removeprefix(layer["prefix"]) in summary["mtp_layer_keys"]:
                row(label, info)
        shards = ", ".join(sorted({info["shard"] for info in layer["tensors"]}))
        where.add_row(label, f"{layer['prefix']}* ({len(layer['tensors'])} tensors)", shards, "", "")
        for key in layer["missing"]:
            where.add_row(label, key, "[red]missing[/red]", "", "")
    return where
