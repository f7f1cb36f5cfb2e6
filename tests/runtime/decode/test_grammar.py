"""Structured output under speculation (runtime/decode/grammar.py), against xgrammar itself: each verified position's
mask is the one a fresh matcher that accepted the output and the drafts before it fills, applied as xgrammar's own
kernel applies it; the walk through the drafts is rolled back; a step's tokens advance the matcher and the next
drafts are cut after their valid prefix. Then end to end on the demo at PP 2: speculative output under a JSON schema
is plain decoding's token for token, valid against the schema, with grammar-invalid drafts cut, while the
no-rollback fault breaks it. (vLLM's tokens and acceptance counts under a grammar: the peer
suite.)"""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from specdoctor.runtime.checkpoint.files import resolve_model_path
from specdoctor.runtime.checkpoint.tokenizer import TOKENIZER_FILE, TextCodec, model_eos_token_ids
from specdoctor.runtime.decode.grammar import (
    CUT_BASE,
    GrammarRequest,
    ReasoningWait,
    RowGrammars,
    grammar_compiler,
    real_drafts,
    verified_counts,
)
from specdoctor.runtime.engine import Engine
from specdoctor.runtime.options import RuntimeOptions

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
JSON = GrammarRequest("json", json.dumps(SCHEMA))
DEMO_TOKENIZER = resolve_model_path("demo") / TOKENIZER_FILE
VOCAB = 2048  # the demo's config vocabulary
DEMO_EOS = model_eos_token_ids(DEMO_TOKENIZER.parent, ())


def fresh_matcher(request: GrammarRequest, tokens: list[int]) -> xgr.GrammarMatcher:
    matcher = xgr.GrammarMatcher(grammar_compiler(DEMO_TOKENIZER, VOCAB, DEMO_EOS).compile_grammar(request.grammar()))
    assert all(matcher.accept_token(token) for token in tokens)
    return matcher


def xgrammar_masked(logits: torch.Tensor, matcher: xgr.GrammarMatcher) -> torch.Tensor:
    """One position's logits [V] masked by xgrammar's own fill and its own CPU kernel."""
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    masked = logits.float().clone()[None]
    xgr.apply_token_bitmask_inplace(masked, bitmask)
    return masked[0]


def allowed(matcher: xgr.GrammarMatcher) -> torch.Tensor:
    return torch.isfinite(xgrammar_masked(torch.zeros(VOCAB), matcher))


# '{', '"', 'name', '":', ' "', 'A', 'n', 'n', '",', ...: a reply the schema allows, in the demo's tokens
WALK = TextCodec(DEMO_TOKENIZER).encode('{"name": "Ann", "age": 41}')


@pytest.mark.parametrize("keep_rejected", [False, True], ids=["healthy", "grammar-no-rollback"])
def test_each_verified_position_is_masked_from_the_output_and_the_drafts_before_it(keep_rejected):
    """Row 0: three drafts the grammar allows; row 1: its second draft one it rules out, so positions past it are
    left alone (the step cannot reach them); row 2: unconstrained. Afterwards a matcher is where the output left
    it, unless the walk is kept (the fault), and then the next step's first mask is no longer the output's."""
    output, drafts = WALK[:3], WALK[3:6]  # the drafts close the key and open the value
    ruled_out = int((~allowed(fresh_matcher(JSON, WALK[:4]))).nonzero()[0])
    matchers = [fresh_matcher(JSON, output), fresh_matcher(JSON, output), None]
    grammars = RowGrammars(matchers, VOCAB, keep_rejected)
    logits = torch.randn(3, 4, VOCAB, generator=torch.Generator().manual_seed(1))
    verified = torch.tensor([drafts, [drafts[0], ruled_out, drafts[2]], drafts])
    masked = grammars.constrain(logits, verified, [True, True, True])
    for j in range(4):
        assert torch.equal(masked[0, j], xgrammar_masked(logits[0, j], fresh_matcher(JSON, output + drafts[:j])))
    for j in range(2):
        assert torch.equal(masked[1, j], xgrammar_masked(logits[1, j], fresh_matcher(JSON, output + drafts[:j])))
    assert torch.equal(masked[1, 2:], logits[1, 2:].float()) and torch.equal(masked[2], logits[2].float())
    assert torch.isinf(masked[1, 1, ruled_out])  # the draft the grammar rules out cannot be accepted
    again = grammars.constrain(logits[:, :1], None, [True, True, True])[0, 0]
    left_at = output + drafts if keep_rejected else output
    assert torch.equal(again, xgrammar_masked(logits[0, 0], fresh_matcher(JSON, left_at)))
    assert not torch.equal(allowed(fresh_matcher(JSON, output)), allowed(fresh_matcher(JSON, output + drafts)))


def test_a_steps_tokens_advance_the_matcher_and_the_next_drafts_are_cut_after_their_valid_prefix():
    """k 3. Row 0 accepted 2 drafts (3 tokens emitted), and of its next drafts the second is one the grammar rules
    out: the matcher is past the 3 tokens, and the drafts from the second on are cut (verified: 1), their tokens kept
    for the pass. Row 1 decodes plainly next (no drafts); row 2 has finished: both left alone."""
    k, pad = 3, -1
    ruled_out = int((~allowed(fresh_matcher(JSON, WALK[:7]))).nonzero()[0])
    grammars = RowGrammars(
        [fresh_matcher(JSON, WALK[:3]), fresh_matcher(JSON, WALK[:3]), fresh_matcher(JSON, [])], VOCAB
    )
    decision = torch.tensor(
        [
            [2, *WALK[3:6], pad, WALK[6], ruled_out, WALK[8]],
            [0, WALK[3], pad, pad, pad, pad, pad, pad],
            [0, 5, pad, pad, pad, 7, 7, 7],
        ]
    )
    cut = grammars.advance_and_cut(decision, k, [True, True, False])
    assert cut[0, k + 2 :].tolist() == [WALK[6], CUT_BASE - ruled_out, CUT_BASE - WALK[8]]
    assert torch.equal(cut[:, : k + 2], decision[:, : k + 2]) and torch.equal(cut[1:], decision[1:])
    assert verified_counts(cut[:, k + 2 :]).tolist() == [1, 0, 3] and torch.equal(real_drafts(cut), decision)
    logits = torch.randn(3, 1, VOCAB, generator=torch.Generator().manual_seed(3))
    masked = grammars.constrain(logits, None, [True, True, False])
    assert torch.equal(masked[0, 0], xgrammar_masked(logits[0, 0], fresh_matcher(JSON, WALK[:6])))
    assert torch.equal(masked[1, 0], xgrammar_masked(logits[1, 0], fresh_matcher(JSON, WALK[:4])))
    assert torch.equal(masked[2], logits[2].float())


END, THINK = 370, 14  # a reasoning's end (' """', one token) and a token of its text


@pytest.mark.parametrize("unmasked_after_end", [False, True], ids=["healthy", "reasoning-end-unmasked"])
def test_a_rows_grammar_starts_after_its_reasoning_ends_inside_the_drafts(unmasked_after_end):
    """Behind a reasoning parser, position j follows the first j drafts: row 0's end is its second draft, so
    positions 0 and 1 are free and position 2 on masked from the grammar's start; row 1's end is two tokens, the
    first emitted already and the second its first draft; row 2's reasoning goes on through the step (free). With
    the fault, a step whose drafts end the reasoning masks nothing. The walk is rolled back either way."""
    end_pair = (THINK, END)
    waits = [ReasoningWait(((END,),)), ReasoningWait((end_pair,), tail=(THINK,)), ReasoningWait(((END,),))]
    matchers = [fresh_matcher(JSON, []) for _ in range(3)]
    grammars = RowGrammars(matchers, VOCAB, waits=waits, unmasked_after_end=unmasked_after_end)
    logits = torch.randn(3, 4, VOCAB, generator=torch.Generator().manual_seed(2))
    drafts = torch.tensor([[THINK, END, WALK[0]], [END, WALK[0], WALK[1]], [THINK, THINK, THINK]])
    masked = grammars.constrain(logits, drafts, [True, True, True])
    assert torch.equal(masked[2], logits[2].float())
    if unmasked_after_end:
        assert torch.equal(masked, logits.float())
        return
    assert torch.equal(masked[0, :2], logits[0, :2].float()) and torch.equal(masked[1, :1], logits[1, :1].float())
    for row, start in ((0, 2), (1, 1)):
        for j in range(start, 4):
            walked = drafts[row, start:j].tolist()
            assert torch.equal(masked[row, j], xgrammar_masked(logits[row, j], fresh_matcher(JSON, walked)))
    again = grammars.constrain(logits[:, :1], None, [True, True, True])  # still waiting: nothing was emitted
    assert torch.equal(again, logits[:, :1].float())


def test_a_steps_tokens_after_the_end_of_reasoning_advance_the_matcher_and_later_drafts_are_cut():
    """k 3. Row 0 emits a reasoning token, the end and a first JSON token: the matcher is past that token alone and
    the row no longer waits. Row 1 emits reasoning only; its next drafts end the reasoning, then one the grammar rules
    out (cut); it still waits, with the tokens it emitted kept for an end that spans steps."""
    k, pad = 3, -1
    ruled_out = int((~allowed(fresh_matcher(JSON, []))).nonzero()[0])
    waits = [ReasoningWait(((END,),)), ReasoningWait(((END,),))]
    grammars = RowGrammars([fresh_matcher(JSON, []), fresh_matcher(JSON, [])], VOCAB, waits=waits)
    decision = torch.tensor(
        [
            [2, THINK, END, WALK[0], pad, pad, pad, pad],
            [0, THINK, pad, pad, pad, END, ruled_out, WALK[0]],
        ]
    )
    cut = grammars.advance_and_cut(decision, k, [True, True])
    assert torch.equal(cut[0], decision[0])
    assert cut[1, k + 2 :].tolist() == [END, CUT_BASE - ruled_out, CUT_BASE - WALK[0]]
    assert grammars.waits[0] is None and grammars.waits[1].tail == ()  # a one-token end keeps no tail
    logits = torch.randn(2, 1, VOCAB, generator=torch.Generator().manual_seed(4))
    masked = grammars.constrain(logits, None, [True, True])
    assert torch.equal(masked[0, 0], xgrammar_masked(logits[0, 0], fresh_matcher(JSON, WALK[:1])))
    assert torch.equal(masked[1, 0], logits[1, 0].float())


def test_a_reasoning_end_is_found_across_the_tokens_emitted_before():
    wait = ReasoningWait(((THINK, END), (5, 6, 7)))
    wait.emitted([1, 5])
    assert wait.tail == (1, 5) and wait.end_in([6, 7, 9]) == 1 and wait.end_in([6, 9]) is None
    wait.emitted([6])
    assert wait.tail == (5, 6) and wait.end_in([7]) == 0 and wait.end_in([THINK, END]) == 1


@pytest.mark.parametrize(
    "kind, spec, said",
    [
        ("json", '{"type": 5}', "the json cannot be compiled by xgrammar: "),
        ("regex", "([a-", "the regex cannot be compiled by xgrammar: Regex parsing error at position"),
        ("grammar", "root ::= ", "the grammar cannot be compiled by xgrammar: "),
        ("choice", "[]", "the choice cannot be compiled by xgrammar: EBNF parser error"),
    ],
)
def test_a_grammar_xgrammar_refuses_is_one_line_naming_it(kind, spec, said):
    with pytest.raises(ValueError) as refused:
        GrammarRequest(kind, spec).grammar()
    message = str(refused.value)
    assert message.startswith(said) and "\n" not in message and ".cc:" not in message


@pytest.mark.parametrize("fault", [None, "grammar-no-rollback"])
def test_speculative_output_under_a_schema_is_plain_decodings_and_valid(fault):
    """PP 2, three prompts batched, k 3 against k 0 (greedy): the same tokens, each finished reply valid JSON against
    the schema, and drafts the grammar rules out cut before verification. With the matcher left after the rejected
    drafts (the fault), the output is no longer plain decoding's."""
    codec = TextCodec(DEMO_TOKENIZER)
    prompts = [codec.encode(text) for text in ("A person as JSON:", "The weather today", "Numbers: 1, 2,")]
    with Engine(RuntimeOptions("demo", pp=2, num_speculative_tokens=3, fault=fault, timeout=120)) as engine:
        plain, speculative, free = (
            engine.generate(prompts, 48, num_speculative_tokens=k, grammar=g)
            for k, g in ((0, JSON), (3, JSON), (3, None))
        )
    if fault:
        assert speculative.tokens != plain.tokens
        return
    assert speculative.tokens == plain.tokens and speculative.tokens != free.tokens
    stopped = [codec.decode(out) for out, why in zip(plain.tokens, plain.finish_reasons, strict=True) if why == "stop"]
    assert stopped and all(set(json.loads(text)) == {"name", "age"} for text in stopped)
    # drafts the grammar rules out are cut, not verified: steps verify fewer than k, where unconstrained ones never do
    assert speculative.metrics.num_draft_tokens < 3 * speculative.metrics.num_drafts
    assert free.metrics.num_draft_tokens == 3 * free.metrics.num_drafts
