"""Findings about a DSpark drafter beside its target: the pre-flight from both checkpoints' headers, and what
the tap probe measured through the live pipeline (runtime/tap_probe.py). docs/dspark.md says what vLLM
0.32 does with each."""

from __future__ import annotations

from specdoctor.checks.drafter_checkpoint import aux_relay, drafter_tensors, placement_findings
from specdoctor.checks.kind_checks import KindChecks
from specdoctor.checks.quantization import quantization
from specdoctor.report import Finding
from specdoctor.runtime.drafter.dspark import DSparkKind
from specdoctor.runtime.models.dspark import pairing_problems
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
        unloaded = "vLLM 0.32 refuses to load it there"
        findings += drafter_tensors(kind) + placement_findings(kind, ranks, unloaded)
    return findings + aux_relay(kind, ranks) + quantization(drafter)


CHECKS = KindChecks(DSparkKind, dspark_preflight)
