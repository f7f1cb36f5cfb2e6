"""LinearStates (runtime/cache/linear_state.py): a forward stages each linear-attention layer's states per
position; the commit keeps, per row, the ones after its last accepted token (a prompt pass: its last real
token), leaves finished rows alone, and without rollback keeps the last verified position; regrouping keeps
each row's states.

Oracles: indexing the staged tensors by hand, and a recurrence recomputed from scratch in plain torch over
only the tokens a row kept."""

from __future__ import annotations

import pytest
import torch

from specdoctor.runtime.cache.linear_state import LinearStates

CONV = (6, 3)  # channels, kernel - 1
STATE = (2, 3, 4)  # value heads, key dim, value dim


def states_for(batch: int, layers=(0, 2), rollback: bool = True) -> LinearStates:
    return LinearStates(list(layers), batch, CONV, STATE, torch.float64, "cpu", rollback)


def staged(batch: int, length: int, generator, per_position: bool = True):
    """Random windows [B, T, C, K-1] and states [B, T or 1, heads, Dk, Dv] (fp32, as the layer makes them)."""
    windows = torch.randn(batch, length, *CONV, generator=generator, dtype=torch.float64)
    after = torch.randn(batch, length if per_position else 1, *STATE, generator=generator)
    return windows, after


def test_a_verification_pass_commits_each_rows_states_after_its_last_accepted_token():
    generator = torch.Generator().manual_seed(0)
    states = states_for(3)
    states.begin(valid_end=None, keep_positions=True)
    forward = {layer: staged(3, 4, generator) for layer in (0, 2)}  # the pending token and 3 drafts
    for layer, (windows, after) in forward.items():
        states.stage(layer, windows, after)
    accepted = torch.tensor([0, 3, 1])
    states.commit(accepted, torch.tensor([True, True, True]))
    for layer, (windows, after) in forward.items():
        for row, at in enumerate(accepted.tolist()):
            assert torch.equal(states.conv[layer][row], windows[row, at])
            assert torch.equal(states.recurrent[layer][row], after[row, at])
    assert states.pending == {}


def test_a_row_left_out_of_the_commit_keeps_its_states():
    """Finished rows stay in the batch but stop advancing (BatchState.advance commits only active rows)."""
    generator = torch.Generator().manual_seed(1)
    states = states_for(3, layers=(5,))
    states.conv[5] = torch.randn(3, *CONV, generator=generator, dtype=torch.float64)
    states.recurrent[5] = torch.randn(3, *STATE, generator=generator)
    before = (states.conv[5].clone(), states.recurrent[5].clone())
    states.begin(valid_end=None, keep_positions=True)
    windows, after = staged(3, 4, generator)
    states.stage(5, windows, after)
    states.commit(torch.tensor([2, 2, 2]), torch.tensor([True, False, True]))
    assert torch.equal(states.conv[5][1], before[0][1]) and torch.equal(states.recurrent[5][1], before[1][1])
    for row in (0, 2):
        assert torch.equal(states.conv[5][row], windows[row, 2])
        assert torch.equal(states.recurrent[5][row], after[row, 2])


@pytest.mark.parametrize("rollback", [True, False])
def test_a_prompt_pass_keeps_the_window_at_each_rows_end_and_its_one_final_state(rollback):
    """A prompt pass stages one delta-rule state per row (the layer masked the padding past the row's end),
    and the conv windows per position: the commit takes the window at the row's last token, with or
    without rollback (there is nothing to roll back in a prompt)."""
    generator = torch.Generator().manual_seed(2)
    states = states_for(2, layers=(1,), rollback=rollback)
    lengths = torch.tensor([3, 7])
    states.begin(valid_end=lengths, keep_positions=False)
    assert torch.equal(states.valid_end, lengths) and not states.keep_positions
    windows, after = staged(2, 7, generator, per_position=False)
    states.stage(1, windows, after)
    states.commit(lengths - 1, torch.tensor([True, True]))
    assert torch.equal(states.conv[1], torch.stack([windows[0, 2], windows[1, 6]]))
    assert torch.equal(states.recurrent[1], after[:, 0])


def test_without_rollback_the_last_verified_position_is_kept_rejected_or_not():
    """`rollback=False` reproduces an engine that keeps the state after every verified token."""
    generator = torch.Generator().manual_seed(3)
    states = states_for(2, layers=(0,), rollback=False)
    states.begin(valid_end=None, keep_positions=True)
    windows, after = staged(2, 4, generator)
    states.stage(0, windows, after)
    states.commit(torch.tensor([0, 2]), torch.tensor([True, True]))
    assert torch.equal(states.conv[0], windows[:, 3]) and torch.equal(states.recurrent[0], after[:, 3])


def test_begin_forgets_what_an_uncommitted_forward_staged():
    generator = torch.Generator().manual_seed(4)
    states = states_for(1)
    states.begin(valid_end=None, keep_positions=True)
    states.stage(0, *staged(1, 2, generator))  # a forward whose commit never came
    states.begin(valid_end=None, keep_positions=True)
    windows, after = staged(1, 2, generator)
    states.stage(2, windows, after)
    states.commit(torch.tensor([1]), torch.tensor([True]))
    assert not states.conv[0].any() and not states.recurrent[0].any()
    assert torch.equal(states.conv[2][0], windows[0, 1]) and torch.equal(states.recurrent[2][0], after[0, 1])


DECAY = 0.5


def toy_layer(states: LinearStates, layer: int, inputs: torch.Tensor, positions: torch.Tensor) -> None:
    """A linear-attention layer in miniature, staging what it runs through: a causal window of the last K-1
    inputs (channels = inputs' width) and the recurrence h <- DECAY * h + outer(x[:Dk], x[:Dv]) per value
    head, from the committed states; positions at or past a row's valid_end leave h as it was."""
    batch, length, channels = inputs.shape
    kernel = CONV[1] + 1
    sequence = torch.cat([states.conv[layer], inputs.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
    windows = torch.stack([sequence[:, :, t + 1 : t + kernel] for t in range(length)], dim=1)
    h = states.recurrent[layer].clone()
    afters = []
    for t in range(length):
        x = inputs[:, t].float()
        update = DECAY * h + torch.einsum("bk,bv->bkv", x[:, : STATE[1]], x[:, : STATE[2]])[:, None]
        real = torch.ones(batch, dtype=torch.bool) if states.valid_end is None else positions[:, t] < states.valid_end
        h = torch.where(real[:, None, None, None], update, h)
        afters.append(h)
    after = torch.stack(afters, dim=1) if states.keep_positions else h[:, None]
    states.stage(layer, windows, after)


def from_scratch(tokens: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(window, state) after running one row's kept inputs [C] from zeros, in plain torch."""
    inputs = torch.stack(tokens)  # [N, C]
    padded = torch.cat([torch.zeros(CONV[1], CONV[0], dtype=inputs.dtype), inputs])
    window = padded[-CONV[1] :].T
    h = torch.zeros(STATE, dtype=torch.float32)
    for x in inputs.float():
        h = DECAY * h + torch.outer(x[: STATE[1]], x[: STATE[2]])[None]
    return window, h


def test_prompt_then_speculative_steps_leave_each_row_with_the_states_of_exactly_its_kept_tokens():
    """Two rows of different prompt lengths (one padded), then two verification passes of a pending token
    and 3 drafts each, the rows accepting different counts: after each commit every row's states equal a
    recurrence run from scratch over only the tokens it kept."""
    generator = torch.Generator().manual_seed(5)
    states = states_for(2, layers=(3,))
    lengths = [2, 5]
    prompt = torch.randn(2, 5, CONV[0], generator=generator, dtype=torch.float64)
    states.begin(valid_end=torch.tensor(lengths), keep_positions=False)
    toy_layer(states, 3, prompt, torch.arange(5).expand(2, -1))
    states.commit(torch.tensor(lengths) - 1, torch.tensor([True, True]))
    kept = [list(prompt[row, : lengths[row]]) for row in range(2)]
    for row in range(2):
        window, h = from_scratch(kept[row])
        assert torch.equal(states.conv[3][row], window)
        torch.testing.assert_close(states.recurrent[3][row], h, rtol=1e-6, atol=1e-6)

    filled = list(lengths)
    for accepted in ([1, 3], [0, 2]):
        verified = torch.randn(2, 4, CONV[0], generator=generator, dtype=torch.float64)
        positions = torch.tensor(filled)[:, None] + torch.arange(4)
        states.begin(valid_end=None, keep_positions=True)
        toy_layer(states, 3, verified, positions)
        states.commit(torch.tensor(accepted), torch.tensor([True, True]))
        for row in range(2):
            kept[row] += list(verified[row, : accepted[row] + 1])  # the pending token and its accepted drafts
            filled[row] += accepted[row] + 1
            window, h = from_scratch(kept[row])
            assert torch.equal(states.conv[3][row], window)
            torch.testing.assert_close(states.recurrent[3][row], h, rtol=1e-6, atol=1e-6)


def test_regroup_concatenates_then_selects_rows_and_starts_with_nothing_pending():
    generator = torch.Generator().manual_seed(6)
    first, second = states_for(2, rollback=False), states_for(3, rollback=False)
    for source in (first, second):
        batch = len(source.conv[0])
        for layer in (0, 2):
            source.conv[layer] = torch.randn(batch, *CONV, generator=generator, dtype=torch.float64)
            source.recurrent[layer] = torch.randn(batch, *STATE, generator=generator)
    first.begin(torch.tensor([1, 1]), keep_positions=True)
    first.stage(0, *staged(2, 4, generator))
    rows = [3, 0, 4, 1]
    joined = LinearStates.regroup([first, second], rows)
    by_hand = [(first, 0), (first, 1), (second, 0), (second, 1), (second, 2)]
    for layer in (0, 2):
        for i, row in enumerate(rows):
            source, source_row = by_hand[row]
            assert torch.equal(joined.conv[layer][i], source.conv[layer][source_row])
            assert torch.equal(joined.recurrent[layer][i], source.recurrent[layer][source_row])
    assert joined.rollback is False
    assert joined.pending == {} and joined.valid_end is None and not joined.keep_positions
    everything = LinearStates.regroup([first, second], None)
    assert torch.equal(everything.conv[2], torch.cat([first.conv[2], second.conv[2]]))
    assert torch.equal(everything.recurrent[0], torch.cat([first.recurrent[0], second.recurrent[0]]))
