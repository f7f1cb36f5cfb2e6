"""Findings about a draft model beside its target from both checkpoints' headers (docs/draft-model.md says
what vLLM 0.32 does with each): the pairing (vocabulary, tokenizer), the special ids, and its position range."""

from __future__ import annotations

from specdoctor.checks.drafter_checkpoint import drafter_tensors
from specdoctor.checks.kind_checks import KindChecks
from specdoctor.checks.proposals import CONSTANT_PROPOSALS_SHARE
from specdoctor.checks.quantization import quantization
from specdoctor.report import Finding
from specdoctor.runtime.decode.speculative import DUMMY_DRAFT
from specdoctor.runtime.drafter.draft_model import DraftModelKind
from specdoctor.runtime.partition import Placement


def draft_model_preflight(kind: DraftModelKind, ranks: list[Placement]) -> list[Finding]:
    draft, target = kind.drafter.config, kind.target.config
    problems = kind.problems()
    findings = [
        Finding("draft_model.pairing", "error", f"the draft model cannot draft for this target: {problem}")
        for problem in problems
    ]
    findings.append(
        Finding(
            "draft_model.config",
            "info",
            f"draft model {kind.drafter.path.name}: {draft.architecture}, {draft.num_hidden_layers} layer(s), hidden "
            f"{draft.hidden_size}, vocabulary {draft.vocab_size}, position range {draft.max_position_embeddings}; "
            f"its own KV cache on rank {ranks[-1].rank}",
        )
    )
    _, added = kind.tokenizer_differences
    if added and not problems:  # the base vocabularies agree: only added (special) tokens differ
        findings.append(
            Finding(
                "draft_model.special_ids",
                "warning",
                f"the draft model's added tokens differ from the target's: {added}",
                "vLLM gives the draft the target's tokenizer; drafts of a special token the two models read "
                "differently are rejected, the output stays right",
            )
        )
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        findings.append(
            Finding(
                "draft_model.special_ids",
                "warning",
                f"the draft model's end-of-sequence ids {list(draft.eos_token_ids)} are not the target's "
                f"{list(target.eos_token_ids)}",
                "vLLM stops on the target's ids; a draft trained to end elsewhere drafts past the target's end",
            )
        )
    if kind.draft_max_len < target.max_position_embeddings:
        findings.append(position_range_finding(kind))
    if not problems:
        findings += drafter_tensors(kind)
    return findings + quantization(kind.drafter)


def position_range_finding(kind: DraftModelKind) -> Finding:
    length, target = kind.draft_max_len, kind.target.config.max_position_embeddings
    return Finding(
        "draft_model.position_range",
        "warning",
        f"the draft model's position range {length} is shorter than the target's {target}: once a batch's longest "
        f"sequence plus k passes {length} tokens, vLLM 0.32 drafts dummy token 0 for every request in it "
        "(vllm#58080); acceptance goes to 0 while output stays right",
        f"serve with --max-model-len {length}, or pair a draft model of the target's range; no checkpoint read "
        "repairs it",
        data={"draft_max_len": length, "target_max_len": target},
    )


def dummy_draft_findings(kind: DraftModelKind, profile: dict, longest: int, k: int, stage: str) -> list[Finding]:
    """Drafts that are mostly token 0 on a battery whose sequences pass the draft model's range: the engine's
    length gate drafting dummies, not the weights (a wiring fault; `longest`: the battery's longest sequence)."""
    length = kind.draft_max_len
    if longest + k <= length or profile["top_token"] != DUMMY_DRAFT or profile["top_share"] < CONSTANT_PROPOSALS_SHARE:
        return []
    return [
        Finding(
            "draft_model.dummy_drafts",
            "error",
            f"{profile['top_share']:.0%} of {profile['count']} drafts are token {DUMMY_DRAFT} once the battery's "
            f"sequences pass the draft model's position range {length}: the engine drafts dummies past it "
            "(vllm#58080)",
            f"a wiring fault no checkpoint read repairs: serve with --max-model-len {length}, or pair a draft model "
            "of the target's range",
            stage,
            {"draft_max_len": length, "longest_sequence": longest},
        )
    ]


CHECKS = KindChecks(DraftModelKind, draft_model_preflight, behaviour=dummy_draft_findings)
