"""`specdoctor inspect`: what a checkpoint holds, from its headers alone."""

from __future__ import annotations

from collections import Counter

import torch
from rich.console import Console
from rich.table import Table

from specdoctor.runtime.checkpoint import Checkpoint, TensorInfo
from specdoctor.runtime.loader import embedding_candidates
from specdoctor.runtime.mtp import MtpLayer

MTP_PARTS_SHOWN = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
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


def expected_mtp_keys(checkpoint: Checkpoint, layer_id: int) -> list[str]:
    """Every key an MTP layer needs, from the module itself (built on the meta device: no memory)."""
    with torch.device("meta"):
        layer = MtpLayer(checkpoint.config, layer_id)
    return [f"model.layers.{layer_id}.{name}" for name in layer.state_dict()]


def describe(info: TensorInfo | None) -> dict | None:
    if info is None:
        return None
    return {"key": info.key, "shard": info.shard, "dtype": info.dtype, "shape": list(info.shape), "bytes": info.nbytes}


def summarize(checkpoint: Checkpoint) -> dict:
    config = checkpoint.config
    tensors = checkpoint.tensors
    mtp_layers = []
    for layer_id in config.mtp_layer_ids:
        expected = expected_mtp_keys(checkpoint, layer_id)
        prefix = f"model.layers.{layer_id}."
        present = sorted(k for k in tensors if k.startswith(prefix))
        mtp_layers.append(
            {
                "layer": layer_id,
                "tensors": [describe(tensors[k]) for k in present],
                "missing": [k for k in expected if k not in tensors],
            }
        )
    candidates = embedding_candidates(config)
    draft_key = checkpoint.first_present(candidates)
    return {
        "path": str(checkpoint.path),
        "layout": checkpoint.layout,
        "architecture": config.architecture,
        "config": {name: getattr(config, name) for name in CONFIG_FIELDS},
        "num_keys": len(tensors),
        "num_shards": len({t.shard for t in tensors.values()}),
        "total_bytes": sum(t.nbytes for t in tensors.values()),
        "dtypes": dict(Counter(t.dtype for t in tensors.values()).most_common()),
        "embedding": describe(tensors.get("model.embed_tokens.weight")),
        "lm_head": describe(tensors.get("lm_head.weight")),
        "mtp_layers": mtp_layers,
        "draft_embedding": {"key": draft_key, "candidates": candidates},
    }


def render_summary(summary: dict, console: Console) -> None:
    overview = Table(title=f"{summary['path']}", show_header=False)
    overview.add_row("architecture", summary["architecture"])
    overview.add_row("layout", summary["layout"])
    for name, value in summary["config"].items():
        overview.add_row(name, str(value))
    overview.add_row("tensors", f"{summary['num_keys']:,} in {summary['num_shards']} shard(s)")
    overview.add_row("total bytes", f"{summary['total_bytes']:,} ({summary['total_bytes'] / 2**20:.1f} MiB)")
    overview.add_row("dtypes", ", ".join(f"{d}: {n}" for d, n in summary["dtypes"].items()))
    console.print(overview)

    where = Table(title="Where the drafter's tensors live")
    where.add_column("tensor")
    where.add_column("key", overflow="fold")
    where.add_column("shard", overflow="fold")
    where.add_column("dtype")
    where.add_column("shape")
    for label in ("embedding", "lm_head"):
        info = summary[label]
        row = (info["key"], info["shard"], info["dtype"], str(tuple(info["shape"]))) if info else ("absent", "", "", "")
        where.add_row(label, *row)
    for layer in summary["mtp_layers"]:
        prefix = f"model.layers.{layer['layer']}."
        for info in layer["tensors"]:
            part = info["key"][len(prefix) :]
            if part.split(".")[0] in MTP_PARTS_SHOWN:
                where.add_row(
                    f"MTP {layer['layer']}", info["key"], info["shard"], info["dtype"], str(tuple(info["shape"]))
                )
        shards = sorted({info["shard"] for info in layer["tensors"]})
        where.add_row(
            f"MTP {layer['layer']}", f"{prefix}* ({len(layer['tensors'])} tensors)", ", ".join(shards), "", ""
        )
        for key in layer["missing"]:
            where.add_row(f"MTP {layer['layer']}", key, "[red]missing[/red]", "", "")
    console.print(where)

    draft = summary["draft_embedding"]["key"]
    if draft:
        console.print(f"Draft embedding source: [bold]{draft}[/bold] (first present of the candidate keys)")
    else:
        console.print("[red]Draft embedding source: none of the candidate keys is in the checkpoint[/red]")
