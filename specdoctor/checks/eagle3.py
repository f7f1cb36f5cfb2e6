"""Findings about an EAGLE-3 head beside its target from both checkpoints' headers (docs/eagle3.md says what
vLLM 0.32 does with each): the pairing, the aux states it reads and where they come from under PP, and its
draft vocabulary."""

from __future__ import annotations

from specdoctor.checks.drafter_checkpoint import aux_relay, drafter_tensors, placement_findings
from specdoctor.checks.kind_checks import KindChecks
from specdoctor.checks.quantization import quantization
from specdoctor.report import Finding
from specdoctor.runtime.drafter.eagle3 import Eagle3Kind
from specdoctor.runtime.partition import Placement


def eagle3_preflight(kind: Eagle3Kind, ranks: list[Placement]) -> list[Finding]:
    config, layers = kind.drafter.config, kind.target.config.num_hidden_layers
    problems = kind.problems()
    findings = [
        Finding("eagle3.pairing", "error", f"the head cannot draft for this target: {problem}", data={})
        for problem in problems
    ]
    vocabulary = (
        f"draft vocabulary {config.draft_vocab_size} of {config.vocab_size} (d2t)"
        if config.reduced_vocab
        else "the target's whole vocabulary"
    )
    findings.append(
        Finding(
            "eagle3.config",
            "info",
            f"EAGLE-3 head {kind.drafter.path.name} ({config.layout} layout): {config.num_layers} layer(s), "
            f"aux states entering target layers {list(kind.taps)}, {vocabulary}, "
            f"norm_before_fc {config.norm_before_fc}, norm_before_residual {config.norm_before_residual}",
        )
    )
    if config.aux_layer_ids is None:
        findings.append(
            Finding(
                "eagle3.aux_ids",
                "warning",
                f"the config names no aux layer ids: vLLM guesses its default (2, L // 2, L - 3), here the states "
                f"entering layers {list(kind.taps)} of {layers}",
                "a head trained on other layers drafts from the wrong states (vllm#50170: 1.2 % against 58.9 % "
                "acceptance); write eagle_aux_hidden_state_layer_ids into the head's config",
            )
        )
    if not problems:  # else the target's shapes would only repeat the pairing error
        unloaded = "vLLM 0.32 never shares it at PP > 1: it stays unloaded"
        findings += drafter_tensors(kind) + placement_findings(kind, ranks, unloaded)
    return findings + aux_relay(kind, ranks) + quantization(kind.drafter)


CHECKS = KindChecks(Eagle3Kind, eagle3_preflight)
