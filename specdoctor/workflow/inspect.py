"""`inspect`'s summary of a checkpoint from its headers alone: sizes, keys, where the drafter's tensors live,
the placement at TP x PP ranks and the pre-flight's findings (commands/inspect.py renders it)."""

from __future__ import annotations

from collections import Counter

SCHEMA = "specdoctor.inspect/2"  # 2: `drafter_checkpoint` (was `block_drafter`)
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


def inspect_checkpoint(
    model: str, pp: int = 1, tp: int = 1, speculative_model: str | None = None, method: str | None = None
) -> dict:
    """The summary of `model` and the drafter that drafts for it (a drafter checkpoint given or a demo's, else
    its MTP layers)."""
    from specdoctor.runtime.checkpoint.reader import Checkpoint
    from specdoctor.runtime.drafter.registry import drafter_kind

    checkpoint = Checkpoint(model)
    return summarize(checkpoint, pp, drafter_kind(checkpoint, model, speculative_model, method), tp)


def describe(info) -> dict | None:
    """A TensorInfo as JSON, or None for an absent tensor."""
    if info is None:
        return None
    return {"key": info.key, "shard": info.shard, "dtype": info.dtype, "shape": list(info.shape), "bytes": info.nbytes}


def summarize(checkpoint, pp: int = 1, drafter=None, tp: int = 1) -> dict:
    """`drafter`: the kind of drafter that drafts for this target (runtime/drafter/registry.py), or None."""
    from dataclasses import asdict

    from specdoctor.checks.preflight import preflight
    from specdoctor.runtime.architectures import ARCHITECTURES
    from specdoctor.runtime.checkpoint.keys import TARGET_EMBEDDING_KEYS, TARGET_HEAD, target_embedding_key
    from specdoctor.runtime.drafter.mtp import expected_mtp_keys
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
    candidates = drafter.embedding_candidates() if drafter else list(TARGET_EMBEDDING_KEYS)
    return {
        "schema": SCHEMA,
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
        "draft_embedding": {"key": checkpoint.first_present(candidates), "candidates": candidates},
        "drafter_checkpoint": drafter_checkpoint_summary(drafter),
        "placement": [placement_row(rank, tp) for rank in ranks],
        "preflight": [asdict(finding) for finding in preflight(checkpoint, ranks, drafter) + tp_findings(config, tp)],
    }


def tp_findings(config, tp: int) -> list:
    """At --tp > 1, what vLLM refuses of this model's split (check and every runtime command refuse it too)."""
    from specdoctor.errors import SpecdoctorError
    from specdoctor.report import Finding
    from specdoctor.runtime.refusals import refusal

    if tp < 1:
        raise SpecdoctorError(f"--tensor-parallel-size must be at least 1, got {tp}")
    reason = refusal(config, tp)
    hint = "choose a TP size the heads, KV heads, intermediate sizes and padded vocabulary divide by"
    return [Finding("placement.tensor_parallel", "error", f"TP {tp}: {reason}", hint, "preflight")] if reason else []


def drafter_checkpoint_summary(drafter) -> dict | None:
    """A drafter that is a checkpoint of its own: its path, what its kind says of its config, its tensors."""
    own = drafter.checkpoint if drafter else None
    if own is None:
        return None
    tensors = [describe(info) for _, info in sorted(own.tensors.items())]
    return {"path": str(own.path), **drafter.config_summary(), "label": drafter.label, "tensors": tensors}
