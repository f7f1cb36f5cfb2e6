"""Findings about a drafter that is a checkpoint of its own (DSpark, EAGLE-3), from both checkpoints' headers:
its tensors where they must be, and what its placement under PP asks of the engine."""

from __future__ import annotations

import torch

from specdoctor.report import Finding
from specdoctor.runtime.drafter.kind import EMBEDDING, HEAD, DrafterKind
from specdoctor.runtime.drafter.taps import entry_owner
from specdoctor.runtime.partition import Placement

# Targets whose vLLM 0.32 model relays aux hidden states between PP ranks (`supports_aux_hidden_states_over_pp`:
# its Llama and Qwen2 models, which Qwen3's extends); its model runner refuses a tap-reading drafter at PP > 1
# beside any other ("does not support <method> with pipeline parallelism").
AUX_RELAY_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def drafter_tensors(kind: DrafterKind) -> list[Finding]:
    """Every tensor the drafter needs, in the checkpoint that must hold it, with the module's shape."""
    with torch.device("meta"):
        module = kind.module()
    missing, wrong = [], []
    for name, tensor in module.state_dict().items():
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
                f"{kind.name}.tensors",
                "error",
                f"the drafter lacks {len(missing)} tensor(s) and has {len(wrong)} of the wrong shape, first {first}",
                "the drafter checkpoint does not match its config.json",
                data={"missing": missing, "wrong_shape": wrong},
            )
        ]
    sources = {
        name: "the drafter's own" if kind.expected_source(name)[0] is kind.checkpoint else "the target's"
        for name in (EMBEDDING, HEAD)
    }
    return [
        Finding(
            f"{kind.name}.tensors",
            "info",
            f"all drafter tensors present; embedding: {sources[EMBEDDING]}, head: {sources[HEAD]}",
        )
    ]


def placement_findings(kind: DrafterKind, ranks: list[Placement], unloaded: str) -> list[Finding]:
    """Where the taps come from, and the embedding of a drafter that ships none on a rank without the target's.
    `unloaded`: what the deployed engine does with that embedding."""
    layers = [r.layers for r in ranks]
    last = ranks[-1].rank
    owners = {entry - 1: entry_owner(entry, layers) for entry in kind.taps}
    remote = {layer: owner for layer, owner in owners.items() if owner != last}
    where = ", ".join(f"layer {layer}'s output on rank {owner}" for layer, owner in owners.items())
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
    if EMBEDDING not in kind.checkpoint.tensors and not ranks[-1].has_embedding:
        findings.append(
            Finding(
                "placement.drafter_embedding",
                "warning",
                f"the drafter runs on rank {last} with no local embedding and ships none of its own",
                f"{unloaded}; forks that skip sharing at PP > 1 leave it uninitialised "
                "(specdoctor check --repair reads it from the target checkpoint)",
            )
        )
    return findings


def aux_relay(kind: DrafterKind, ranks: list[Placement]) -> list[Finding]:
    """Whether vLLM 0.32 runs this tap-reading drafter at this PP size beside this target at all."""
    architecture = kind.target.config.architecture
    if len(ranks) == 1 or architecture in AUX_RELAY_ARCHITECTURES:
        return []
    return [
        Finding(
            "placement.aux_relay",
            "warning",
            f"vLLM 0.32 refuses the {kind.label} at PP {len(ranks)} beside {architecture}: its model does not relay "
            "aux hidden states between ranks",
            "run it at PP 1 there, or on an engine that relays them (the runtime here does, as vLLM's Llama and "
            "Qwen models do)",
        )
    ]
