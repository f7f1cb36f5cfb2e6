"""Pre-flight checks from the safetensors headers alone: no tensor data is read."""

from __future__ import annotations

from specdoctor.checks.quantization import quantization
from specdoctor.checks.registry import checks_of
from specdoctor.report import Finding
from specdoctor.runtime.architectures import ARCHITECTURES
from specdoctor.runtime.checkpoint.keys import TARGET_HEAD, target_embedding_key
from specdoctor.runtime.checkpoint.reader import Checkpoint
from specdoctor.runtime.drafter.kind import DrafterKind
from specdoctor.runtime.partition import Placement


def preflight(checkpoint: Checkpoint, ranks: list[Placement], drafter: DrafterKind | None = None) -> list[Finding]:
    """`drafter`: the kind of drafter that drafts for this target (runtime/drafter/registry.py), or None; its
    checks module (checks/registry.py) gives its pre-flight and what it keeps in the target's quantisation."""
    findings = config_sanity(checkpoint, drafter is not None)
    if drafter is not None:
        findings += checks_of(drafter).preflight(drafter, ranks)
    findings += engine_placement(checkpoint, ranks) + engine_router(checkpoint)
    findings += checks_of(drafter).quantization(drafter) if drafter is not None else quantization(checkpoint)
    return [Finding(**{**f.__dict__, "stage": "preflight"}) for f in findings]


def sampled_preflight(drafter: DrafterKind | None) -> list[Finding]:
    """The drafter kind's pre-flight findings that read sampled rows, beyond the headers (an MTP layer's own
    copies)."""
    return checks_of(drafter).sampled(drafter) if drafter is not None else []


def config_sanity(checkpoint: Checkpoint, has_drafter: bool = False) -> list[Finding]:
    cfg, tensors = checkpoint.config, checkpoint.tensors
    findings = []
    embedding = tensors.get(target_embedding_key(checkpoint))
    expected = (cfg.vocab_size, cfg.hidden_size)
    if embedding is None:
        findings.append(
            Finding(
                "config.embedding",
                "error",
                "no target embedding tensor under any candidate key",
                "check the checkpoint's key prefix against the candidate list",
            )
        )
    elif embedding.shape != expected:
        findings.append(
            Finding(
                "config.embedding",
                "error",
                f"{embedding.key} has shape {embedding.shape}, config says {expected}",
                "vocab_size or hidden_size in config.json does not match the weights",
            )
        )
    head = tensors.get(TARGET_HEAD)
    if head is None and not cfg.tie_word_embeddings:
        findings.append(
            Finding(
                "config.lm_head",
                "error",
                "lm_head.weight is absent but tie_word_embeddings is false",
                "set tie_word_embeddings or ship lm_head.weight",
            )
        )
    elif head is not None and head.shape != expected:
        findings.append(
            Finding("config.lm_head", "error", f"lm_head.weight has shape {head.shape}, expected {expected}")
        )
    if not has_drafter:
        findings.append(
            Finding(
                "config.mtp",
                "error",
                "num_nextn_predict_layers is 0: the checkpoint has no MTP drafter",
                "use a checkpoint with MTP layers, or run without speculative decoding",
            )
        )
    if not findings:
        findings.append(
            Finding(
                "config",
                "info",
                f"vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, "
                f"{cfg.num_hidden_layers} layers + {cfg.num_nextn_predict_layers} MTP, tied: "
                f"{cfg.tie_word_embeddings}",
            )
        )
    return findings


def engine_router(checkpoint: Checkpoint) -> list[Finding]:
    """A DeepSeek-V3, V3.2 or GLM-5 config that leaves the router unnamed, as transformers' config classes write
    them: the architecture (and transformers) routes with sigmoid scores and the correction bias, vLLM with softmax
    scores and no bias: served by vLLM it is another model than the one trained (docs/engine-semantics.md)."""
    unnamed = [name for name in ("scoring_func", "topk_method") if checkpoint.raw_config.get(name) is None]
    if not (ARCHITECTURES[checkpoint.config.architecture].vllm_router_from_config and unnamed):
        return []
    vllm = (
        ("softmax" if "scoring_func" in unnamed else "sigmoid")
        + " scores "
        + ("and no correction bias" if "topk_method" in unnamed else "with the correction bias")
    )
    return [
        Finding(
            "config.router",
            "error",
            f"{' and '.join(unnamed)} not set: vLLM 0.32 routes this {checkpoint.config.architecture} with {vllm}, "
            "where the architecture (and transformers, and specdoctor's runtime) uses sigmoid scores with the "
            "correction bias: the deployment computes another model than the checkpoint's",
            'add "scoring_func": "sigmoid", "topk_method": "noaux_tc" to config.json (the released configs name them)',
            data={"unnamed": unnamed},
        )
    ]


def ranks_without_moe_layer(config, ranks: list[Placement]) -> list[int]:
    """The ranks vLLM's model refuses to build for a family that needs an MoE layer on every rank."""
    if not (config.n_routed_experts and ARCHITECTURES[config.architecture].needs_moe_layer_per_rank):
        return []
    return [r.rank for r in ranks if not any(config.is_moe_layer(layer) for layer in r.layers)]


def engine_placement(checkpoint: Checkpoint, ranks: list[Placement]) -> list[Finding]:
    architecture = checkpoint.config.architecture
    findings = []
    if len(ranks) > 1 and ARCHITECTURES[architecture].drafter_needs_first_rank:
        findings.append(
            Finding(
                "placement.drafter_rank",
                "warning",
                f"vLLM 0.32's {ARCHITECTURES[architecture].vllm_drafter} drafter reads its inputs only on the first "
                f"pipeline rank, but runs on rank {len(ranks) - 1}: its first draft step fails at PP > 1",
                "serve it at PP 1 on vLLM 0.32 (Qwen3.5's drafter branches on its inputs and runs); specdoctor's "
                "runtime runs it",
            )
        )
    refused = ranks_without_moe_layer(checkpoint.config, ranks)
    if not refused:
        return findings
    where = ", ".join(f"rank {r} (layers [{ranks[r].layers.start}, {ranks[r].layers.stop}))" for r in refused)
    return findings + [
        Finding(
            "placement.moe_layer",
            "warning",
            f"vLLM 0.32's {checkpoint.config.architecture} refuses to build {where}: no MoE layer there "
            "(its model raises 'No ... layer found in model.layers.')",
            "give every rank an MoE layer (--pp-partition or VLLM_PP_LAYER_PARTITION); specdoctor's runtime runs it",
            data={"ranks": refused},
        )
    ]
