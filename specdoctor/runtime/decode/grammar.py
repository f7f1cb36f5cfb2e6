"""Structured output under speculation, as vLLM 0.32 runs it with xgrammar (docs/engine-semantics.md §Structured
output): one grammar matcher per constrained row, on the last rank. Before a step is verified the matcher walks the
row's drafts, filling the bitmask of each verified position from the state the drafts before it leave; the walk is
rolled back, and the bitmask applied to the target's logits, so every emitted token is one the grammar allows. The
drafter's own proposals are not masked (vLLM's are not); as vLLM's scheduler does, a step's emitted tokens advance
the matcher for good and the next drafts are cut after their longest valid prefix: a cut draft is neither verified
nor counted (the decision every rank reads carries it as CUT_BASE - token, so the pass still has a token there).
Behind a reasoning parser a row's grammar waits until its end of reasoning completes in the output, and starts at
the position after it, inside a step's drafts too (vLLM's ConstraintBounds).
xgrammar, and the transformers it imports (about a second), are imported where a grammar is first used."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from specdoctor.errors import SpecdoctorError

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's structured_outputs options
CUT_BASE = -2  # a cut draft d is CUT_BASE - d in the decision: below PLACEHOLDER (-1), which means no drafts


def real_drafts(drafts: torch.Tensor) -> torch.Tensor:
    """The decision's drafts [B, k] with each cut one's token back (the pass runs on it; verification rejects it)."""
    return torch.where(drafts <= CUT_BASE, CUT_BASE - drafts, drafts)


def real_draft(token: int) -> int:
    return CUT_BASE - token if token <= CUT_BASE else token


def verified_counts(drafts: torch.Tensor) -> torch.Tensor:
    """How many of each row's drafts [B, k] are verified: those before the first cut one (none: no drafts)."""
    return (drafts >= 0).long().cumprod(dim=1).sum(dim=1)


@dataclass(frozen=True)
class GrammarRequest:
    """What a request's output must match: `kind` one of GRAMMAR_KINDS, `spec` its text (a JSON schema, a regex, an
    EBNF grammar, or the choices as a JSON list)."""

    kind: str
    spec: str = ""
    # The token sequences that end a reasoning the prompt left open (a reasoning parser's): the grammar applies only
    # after the first of them completes in the output. Empty: from the first token.
    after: tuple[tuple[int, ...], ...] = ()

    def grammar(self):
        """xgrammar's Grammar for it; ValueError naming what is wrong when it cannot be one."""
        import xgrammar as xgr

        try:
            if self.kind == "json":
                return xgr.Grammar.from_json_schema(self.spec, any_whitespace=True)
            if self.kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=True)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.spec)
            if self.kind == "choice":
                return xgr.Grammar.from_ebnf(choice_grammar(json.loads(self.spec)))
            if self.kind == "grammar":
                return xgr.Grammar.from_ebnf(self.spec)
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse errors are RuntimeErrors
            said = str(error).strip().splitlines() or [type(error).__name__]
            first = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", said[0])  # xgrammar's time and source line
            raise ValueError(f"the {self.kind} cannot be compiled by xgrammar: {first}") from None
        raise ValueError(f"unknown kind of structured output {self.kind!r} (choose from {', '.join(GRAMMAR_KINDS)})")


def choice_grammar(choices: list[str]) -> str:
    """vLLM's grammar for `choice`: one EBNF literal per choice, escaped as vLLM escapes them."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def literal(text: str) -> str:
        return "".join(
            escapes.get(ch) or (f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch) for ch in text
        )

    return "root ::= " + " | ".join(f'"{literal(choice)}"' for choice in choices)


@lru_cache(maxsize=4)
def grammar_compiler(tokenizer_file: Path, vocab_size: int, eos_ids: tuple[int, ...] = ()):
    """xgrammar's compiler for a tokenizer, built as vLLM builds it (`TokenizerInfo.from_huggingface` over the
    model's vocabulary size, ending at its EOS ids), once per process; it caches compiled grammars itself."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids) or None)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's bitmask [N, ceil(V / 32)] int32 (bit b of word w: token 32w + b allowed) as booleans [N, V]."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]


@dataclass
class ReasoningWait:
    """A row whose grammar waits for the end of its reasoning: one of `ends` (token sequences) completing in its
    output. `tail` keeps the last tokens emitted, as many as an end can need before the next one."""

    ends: tuple[tuple[int, ...], ...]
    tail: tuple[int, ...] = ()

    def end_in(self, tokens: list[int]) -> int | None:
        """The index in `tokens` (which follow those emitted) at which an end first completes, or None."""
        seen = self.tail + tuple(tokens)
        for i in range(len(tokens)):
            upto = len(self.tail) + i + 1
            if any(upto >= len(end) and seen[upto - len(end) : upto] == end for end in self.ends):
                return i
        return None

    def emitted(self, tokens: list[int]) -> None:
        keep = max(len(end) for end in self.ends) - 1
        self.tail = (self.tail + tuple(tokens))[-keep:] if keep else ()


class RowGrammars:
    """A batch's matchers on the last rank, one per row (None where the row is unconstrained), and each row's wait
    for its end of reasoning (None: the grammar applies from the next token)."""

    def __init__(
        self,
        matchers: list,
        vocab_size: int,
        keep_rejected: bool = False,
        waits: list[ReasoningWait | None] | None = None,
        unmasked_after_end: bool = False,
    ):
        self.matchers, self.vocab_size = matchers, vocab_size
        self.keep_rejected = keep_rejected  # --fault grammar-no-rollback: the walk through the drafts stays
        self.waits = waits or [None] * len(matchers)
        # --fault reasoning-end-unmasked: a step whose drafts end the reasoning masks none of its positions
        self.unmasked_after_end = unmasked_after_end

    @property
    def active(self) -> bool:
        return any(matcher is not None for matcher in self.matchers)

    def constrain(self, logits: torch.Tensor, drafts: torch.Tensor | None, active: list[bool]) -> torch.Tensor:
        """logits [B, T, V] with each constrained row's disallowed tokens at -inf (float32); position j is
        masked from the state the row's output and its first j drafts leave (`drafts` [B, T - 1], None when T is
        1). Past a draft the grammar rules out, and once a matcher has ended, positions stay unmasked, as vLLM's:
        the step cannot reach them. Finished rows (not `active`) are left alone."""
        import xgrammar as xgr

        batch, positions, vocab = logits.shape
        bitmask = xgr.allocate_token_bitmask(batch * positions, vocab)  # every token allowed
        walked = drafts.tolist() if drafts is not None else [[] for _ in range(batch)]
        for row, matcher in enumerate(self.matchers):
            if matcher is None or not active[row]:
                continue
            start, wait = 0, self.waits[row]
            if wait is not None:  # position j follows the first j drafts: an end in draft j starts it at j + 1
                end = wait.end_in(walked[row][: positions - 1])
                if end is None or self.unmasked_after_end:
                    continue
                start = end + 1
            advanced = 0
            for j in range(start, positions):
                if matcher.is_terminated():
                    break
                matcher.fill_next_token_bitmask(bitmask, row * positions + j)
                if j == positions - 1 or not matcher.accept_token(walked[row][j]):
                    break
                advanced += 1
            if advanced and not self.keep_rejected:
                matcher.rollback(advanced)
        allowed = allowed_tokens(bitmask.to(logits.device), vocab).view_as(logits)
        return logits.float().masked_fill(~allowed, -torch.inf)

    def advance_and_cut(self, decision: torch.Tensor, k: int, active: list[bool]) -> torch.Tensor:
        """The last rank's decision [B, 2k + 2] once each constrained row's emitted tokens have advanced its matcher
        for good (a token it refuses leaves it where it was: only the faulty walk leaves it where a token does not
        fit), with the next drafts after their longest valid prefix cut (vLLM's `validate_tokens`)."""
        rows = [row for row, matcher in enumerate(self.matchers) if matcher is not None and active[row]]
        if not rows:
            return decision
        host = decision.tolist()
        for row in rows:
            matcher, wait, (accepted, *rest) = self.matchers[row], self.waits[row], host[row]
            emitted, drafts = rest[: accepted + 1], rest[k + 1 :]
            drafts = drafts[: next((j for j, token in enumerate(drafts) if token < 0), len(drafts))]  # < 0: none
            first = 0  # the first draft the grammar judges
            if wait is not None and (end := wait.end_in(emitted)) is not None:
                self.waits[row], emitted = None, emitted[end + 1 :]
            elif wait is not None:
                wait.emitted(emitted)
                if (end := wait.end_in(drafts)) is None:
                    continue
                emitted, first = [], end + 1
            for token in emitted:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
            walked = 0
            for j, token in enumerate(drafts[first:], start=first):
                if matcher.is_terminated() or not matcher.accept_token(token):
                    host[row][k + 2 + j :] = [CUT_BASE - t for t in rest[k + 1 + j :]]
                    break
                walked += 1
            if walked:
                matcher.rollback(walked)
        return torch.tensor(host, dtype=decision.dtype, device=decision.device)

    @staticmethod
    def join(sources: list["RowGrammars"], rows: list[int] | None) -> "RowGrammars":
        matchers = [matcher for source in sources for matcher in source.matchers]
        kept = matchers if rows is None else [matchers[r] for r in rows]
        waits = [wait for source in sources for wait in source.waits]
        kept_waits = waits if rows is None else [waits[r] for r in rows]
        first = sources[0]
        return RowGrammars(kept, first.vocab_size, first.keep_rejected, kept_waits, first.unmasked_after_end)


def batch_grammars(model, sequences: list, k: int) -> RowGrammars:
    """The last rank's matchers for a batch's rows (`model` a RankModel). Each grammar is compiled for the model's
    tokenizer and ends at the row's stop ids (vLLM's `override_stop_tokens`: the EOS ids and the request's
    stop_token_ids); a matcher can roll back a step's k drafts. The faults are kept on an unconstrained batch too:
    its rows may join constrained ones."""
    vocab, faults = model.stage.config.vocab_size, model.faults
    matchers, waits = [None] * len(sequences), [None] * len(sequences)
    if any(sequence.grammar is not None for sequence in sequences):
        if model.tokenizer is None:
            raise SpecdoctorError("structured output needs the model's tokenizer.json (or --tokenizer)")
        import xgrammar as xgr

        compiler = grammar_compiler(model.tokenizer, vocab, model.eos_token_ids)
        for row, sequence in enumerate(sequences):
            if (grammar := sequence.grammar) is None:
                continue
            compiled = compiler.compile_grammar(grammar.grammar())
            stops = list(sequence.stop_token_ids) or None
            matchers[row] = xgr.GrammarMatcher(compiled, override_stop_tokens=stops, max_rollback_tokens=k)
            waits[row] = ReasoningWait(grammar.after) if grammar.after else None
    return RowGrammars(matchers, vocab, faults.grammar_no_rollback, waits, faults.reasoning_end_unmasked)
