"""`specdoctor inspect`: what a checkpoint holds, from its headers alone."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdoctor.commands.options import (
    JsonReportOption,
    ModelOption,
    SpeculativeConfigOption,
    runtime_field_option,
)
from specdoctor.commands.output import emit_json_or_table
from specdoctor.report import Finding, findings_table, placement_table

PipelineSizeOption = runtime_field_option("pp")
TensorParallelOption = runtime_field_option("tp")
SpeculativeModelOption = runtime_field_option("speculative_model")
SpeculativeMethodOption = runtime_field_option("speculative_method")


def inspect(
    model: ModelOption,
    pp: PipelineSizeOption = 1,
    tp: TensorParallelOption = 1,
    speculative_model: SpeculativeModelOption = None,
    speculative_method: SpeculativeMethodOption = None,
    speculative_config: SpeculativeConfigOption = None,
    json_out: JsonReportOption = None,
) -> None:
    """Describe a checkpoint from its headers alone, for any architecture whose MTP layout is known: sizes,
    keys, where the drafter's tensors live (a drafter checkpoint's too), the placement at --tp x --pp ranks and
    the pre-flight's findings."""
    from specdoctor.runtime.drafter.registry import options_from_speculative_config
    from specdoctor.workflow.inspect import inspect_checkpoint

    if speculative_config is not None:  # its drafter fields over the flags, as every runtime command reads it
        fields = options_from_speculative_config(speculative_config)
        speculative_model = fields.get("speculative_model", speculative_model)
        speculative_method = fields.get("speculative_method", speculative_method)
    summary = inspect_checkpoint(model, pp, tp, speculative_model, speculative_method)
    emit_json_or_table(json.dumps(summary, indent=2) + "\n", json_out, lambda console: render_summary(summary, console))


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
    own = summary["drafter_checkpoint"]
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
