"""The logit adjustments at each verified position, where their semantics need no oracle: min_tokens counts the
drafts before a position, logit_bias adds, a row without adjustments is untouched, and rows do not mix. (The
penalties' values are checked against vLLM's own functions in the peer suite.)"""

from __future__ import annotations

import torch

from specdoctor.runtime.decode.adjustments import LogitAdjustments, adjusted_logits
from specdoctor.runtime.decode.requests import SequenceRequest

VOCAB, STOP = 12, 3


def sequence(**wanted) -> SequenceRequest:
    return SequenceRequest([1, 2, 5], 16, stop_token_ids=(STOP, 0), adjustments=LogitAdjustments(**wanted))


def test_min_tokens_masks_the_stop_ids_at_the_positions_whose_output_is_still_short():
    """Two tokens out, three drafts: positions 0 and 1 choose the 3rd and 4th tokens, under min_tokens 4; 2 and 3
    the 5th and 6th, which may stop."""
    logits = torch.randn(1, 4, VOCAB, generator=torch.Generator().manual_seed(0))
    out = adjusted_logits(logits, [sequence(min_tokens=4)], [[7, 8]], torch.tensor([[9, 10, 11]]))[0]
    assert torch.isinf(out[:2, [STOP, 0]]).all() and (out[:2, [STOP, 0]] < 0).all()
    kept = [t for t in range(VOCAB) if t not in (STOP, 0)]
    assert torch.equal(out[:2, kept], logits[0, :2, kept]) and torch.equal(out[2:], logits[0, 2:])


def test_logit_bias_adds_at_every_position_and_rows_do_not_mix():
    logits = torch.randn(3, 2, VOCAB, generator=torch.Generator().manual_seed(1))
    rows = [sequence(), sequence(logit_bias=((4, 100.0), (6, -5.0))), sequence(presence_penalty=1.0)]
    outputs, drafts = [[4], [4], [4, 4]], torch.tensor([[6], [6], [4]])
    out = adjusted_logits(logits, rows, outputs, drafts)
    assert torch.equal(out[0], logits[0])  # no adjustment asked: untouched
    expected = logits[1].clone()
    expected[:, 4] += 100.0
    expected[:, 6] -= 5.0
    assert torch.equal(out[1], expected)
    alone = adjusted_logits(logits[2:], rows[2:], outputs[2:], drafts[2:])
    assert torch.equal(out[2], alone[0])
    assert torch.equal(out[2, :, 4], logits[2, :, 4] - 1.0)  # presence: once, however many times it came


def test_a_batch_without_adjustments_is_the_same_tensor():
    logits = torch.randn(2, 3, VOCAB)
    assert adjusted_logits(logits, [sequence(), sequence()], [[1], [2]], torch.tensor([[1, 2], [3, 4]])) is logits
