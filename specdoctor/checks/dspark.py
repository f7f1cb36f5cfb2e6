"""Findings about a DSpark drafter beside its target: the pre-flight from both checkpoints' headers, and what
the tap probe measured through the live pipeline (runtime/tap_probe.py). docs/dspark.md says what vLLM
0.32 does with each."""

from __future__ import annotations

import torch

from specdoctor.checks.quantization import quantization
from specdoctor.report import Finding
from specdoctor.runtime.drafter.dspark import HEAD, DrafterCheckpoint, DSparkKind
from specdoctor.runtime.drafter.kind import EMBEDDING
from specdoctor.runtime.drafter.taps import entry_owner
from specdoctor.runtime.models.dspark import DSparkDrafter, pairing_problems
from specdoctor.runtime.partition import Placement


def dspark_preflight(kind: DSparkKind, ranks: list[Placement]) -> list[Finding]:
    drafter, target = kind.drafter, kind.target
    config = drafter.config
    problems = pairing_problems(config, target.config)
    findings = [
        Finding("dspark.pairing", "error", f"the drafter cannot draft for this target: {problem}", data={})
        for problem in problems
    ]
    layers = ", ".join(map(str, config.layer_ids))
    findings.append(
        Finding(
            "dspark.config",
            "info",
            f"DSpark drafter {drafter.path.name}: {config.num_layers} layers, taps after target layers [{layers}], "
            f"block {config.block_size or 'unset'}, Markov rank {config.markov_rank}, "
            f"mask token {config.mask_token_id}",
        )
    )
    if list(config.layer_ids) != sorted(set(config.layer_ids)):
        findings.append(
            Finding(
                "dspark.tap_order",
                "warning",
                f"target_layer_ids {list(config.layer_ids)} are not increasing: vLLM sorts and de-duplicates them, "
                f"so fc reads the taps as {[e - 1 for e in config.tap_entries]}",
                "list the ids in the order the drafter was trained with, increasing",
            )
        )
    if not problems:  # else the target's shapes would only repeat the pairing error
        findings += drafter_tensors(kind) + placement_findings(drafter, ranks)
    return findings + quantization(drafter)


def drafter_tensors(kind: DSparkKind) -> list[Finding]:
    """Every tensor the drafter needs, in the checkpoint that must hold it, with the module's shape."""
    with torch.device("meta"):
        module = DSparkDrafter(kind.drafter.config)
    missing, wrong, names = [], [], set(kind.tensor_names())
    for name, tensor in module.state_dict().items():
        if name not in names:
            continue  # vLLM drops a configured confidence head the checkpoint does not ship
        checkpoint, key = kind.expected_source(name)
        info = checkpoint.tensors.get(key)
        if info is None:
            missing.append(key)
        elif tuple(info.shape) != tuple(tensor.shape):
            wrong.append(f"{key} {tuple(info.shape)} (expected {tuple(tensor.shape)})")
    if missing or wrong:
        first = (missing + wrong)[0]
        return [
            Finding(
                "dspark.tensors",
                "error",
                f"the drafter lacks {len(missing)} tensor(s) and has {len(wrong)} of the wrong shape, first {first}",
                "the drafter checkpoint does not match its config.json",
                data={"missing": missing, "wrong_shape": wrong},
            )
        ]
    own = kind.drafter.tensors
    sources = {name: "the drafter's own" if name in own else "the target's" for name in (EMBEDDING, HEAD)}
    return [
        Finding(
            "dspark.tensors",
            "info",
            f"all drafter tensors present; embedding: {sources[EMBEDDING]}, head: {sources[HEAD]}",
        )
    ]


def placement_findings(drafter: DrafterCheckpoint, ranks: list[Placement]) -> list[Finding]:
    layers = [r.layers for r in ranks]
    last = ranks[-1].rank
    owners = {entry - 1: entry_owner(entry, layers) for entry in drafter.config.tap_entries}
    remote = {layer: owner for layer, owner in owners.items() if owner != last}
    where = ", ".join(f"layer {layer} on rank {owner}" for layer, owner in owners.items())
    findings = [
        Finding(
            "placement.taps",
            "warning" if remote else "info",
            f"taps: {where}; {len(remote)} of {len(owners)} must travel to the drafter's rank {last} every step"
            if remote
            else f"taps: {where}; all on the drafter's rank",
            "an engine that does not relay taps across ranks feeds the drafter zeros for them" if remote else "",
            data={"owners": owners},
        )
    ]
    if EMBEDDING not in drafter.tensors and not ranks[-1].has_embedding:
        findings.append(
            Finding(
                "placement.drafter_embedding",
                "warning",
                f"the drafter runs on rank {last} with no local embedding and ships none of its own",
                "vLLM 0.32 refuses to load it there; forks that skip sharing at PP > 1 leave it uninitialised "
                "(specdoctor check --repair reads it from the target checkpoint)",
            )
        )
    return findings
