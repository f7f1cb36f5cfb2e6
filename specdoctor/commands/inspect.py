"""`specdoctor inspect`: what a checkpoint holds, from its headers alone."""

from __future__ import annotations

import json
import sys
from collections import Counter

from rich.console import Console
from rich.table import Table

from specdoctor.commands.options import JsonFlagOption, ModelOption

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


def inspect(model: ModelOption, as_json: JsonFlagOption = False) -> None:
    """Describe a checkpoint from its headers alone: sizes, keys, where the drafter's tensors live."""
    from specdoctor.runtime.checkpoint import Checkpoint

    summary = summarize(Checkpoint(model))
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    else:
        render_summary(summary, Console())


def describe(info) -> dict | None:
    """A TensorInfo as JSON, or None for an absent tensor."""
    if info is None:
        return None
    return {"key": info.key, "shard": info.shard, "dtype": info.dtype, "shape": list(info.shape), "bytes": info.nbytes}


def summarize(checkpoint) -> dict:
    from specdoctor.runtime.drafter.keys import (
        TARGET_EMBEDDING,
        TARGET_HEAD,
        drafter_embedding_key,
        embedding_candidates,
        expected_mtp_keys,
    )

    config = checkpoint.config
    tensors = checkpoint.tensors
    mtp_layers = []
    for layer_id in config.mtp_layer_ids:
        expected = expected_mtp_keys(config, layer_id)
        prefix = config.mtp_keys.prefix(layer_id)
        present = sorted(k for k in tensors if k.startswith(prefix))
        mtp_layers.append(
            {
                "layer": layer_id,
                "prefix": prefix,
                "tensors": [describe(tensors[k]) for k in present],
                "missing": [k for k in expected if k not in tensors],
            }
        )
    return {
        "path": str(checkpoint.path),
        "layout": checkpoint.layout,
        "architecture": config.architecture,
        "quantization": checkpoint.quantization,
        "config": {name: getattr(config, name) for name in CONFIG_FIELDS},
        "num_keys": len(tensors),
        "num_shards": len({t.shard for t in tensors.values()}),
        "total_bytes": sum(t.nbytes for t in tensors.values()),
        "dtypes": dict(Counter(t.dtype for t in tensors.values()).most_common()),
        "embedding": describe(tensors.get(TARGET_EMBEDDING)),
        "lm_head": describe(tensors.get(TARGET_HEAD)),
        "mtp_layers": mtp_layers,
        "draft_embedding": {"key": drafter_embedding_key(checkpoint), "candidates": embedding_candidates(config)},
    }


def render_summary(summary: dict, console: Console) -> None:
    overview = Table(title=f"{summary['path']}", show_header=False)
    overview.add_row("architecture", summary["architecture"])
    overview.add_row("quantization", summary["quantization"] or "none (floating-point weights)")
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
        prefix = layer["prefix"]
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
