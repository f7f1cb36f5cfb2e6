"""Speculative verification: greedy goldens, and rejection sampling keeps the target distribution."""

from __future__ import annotations

import pytest
import torch

from specdoctor.runtime.decode.rejection import PLACEHOLDER, verify_greedy, verify_random
from specdoctor.runtime.sampling import SamplingParams, greedy_tokens, probabilities

P = PLACEHOLDER


def logits_for(argmaxes: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """Target logits [B, k+1, V] whose argmax at each position is given."""
    out = torch.zeros(len(argmaxes), len(argmaxes[0]), vocab)
    for b, row in enumerate(argmaxes):
        for j, token in enumerate(row):
            out[b, j, token] = 5.0
    return out


def test_greedy_accepts_the_matching_prefix_then_recovers_or_adds_the_bonus():
    drafts = torch.tensor([[3, 4, 5], [3, 4, 5], [3, 4, 5], [1, 4, 5]])
    target = logits_for([[3, 4, 5, 6], [3, 7, 5, 6], [2, 4, 5, 6], [3, 4, 5, 6]])
    accepted, emitted = verify_greedy(drafts, target)
    assert accepted.tolist() == [3, 1, 0, 0]
    assert emitted.tolist() == [[3, 4, 5, 6], [3, 7, P, P], [2, P, P, P], [3, P, P, P]]


def test_greedy_with_no_drafts_emits_the_target_argmax():
    accepted, emitted = verify_greedy(torch.zeros(2, 0, dtype=torch.long), logits_for([[4], [1]]))
    assert accepted.tolist() == [0, 0] and emitted.tolist() == [[4], [1]]


def first_token_frequencies(p: torch.Tensor, q: torch.Tensor, k: int, n: int, seed: int) -> torch.Tensor:
    """Empirical distribution of the first emitted token over n independent verifications."""
    generator = torch.Generator().manual_seed(seed)
    vocab = p.shape[-1]
    drafts = torch.multinomial(q[0].expand(n, -1), 1, replacement=True, generator=generator)
    for j in range(1, k):
        drafts = torch.cat([drafts, torch.multinomial(q[j].expand(n, -1), 1, generator=generator)], dim=1)
    uniform = torch.rand(n, k, generator=generator)
    _, emitted = verify_random(drafts, q.expand(n, -1, -1), p.expand(n, -1, -1), uniform, generator)
    return torch.bincount(emitted[:, 0], minlength=vocab).float() / n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_picks_are_torch_argmax_on_ties_and_nan(dtype):
    """`greedy_tokens` goes through max for speed; torch's argmax is the oracle: the first index on ties (logits
    of a few values repeat at every position) and the NaN's index where a row holds one."""
    generator = torch.Generator().manual_seed(0)
    for vocab in (7, 2048, 151936):
        logits = torch.randint(0, 3, (4, 5, vocab), generator=generator).to(dtype)
        logits[1, 2, vocab // 2] = float("nan")
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("backend, sizes", [("torch", (20_000, 200_000)), ("triton", (300, 1_200))])
def test_rejection_sampling_keeps_the_target_distribution(k, backend, sizes, monkeypatch):
    monkeypatch.setenv("SPECDOCTOR_KERNELS", backend)  # Triton runs through its interpreter on the CPU
    generator = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(k + 1, vocab, generator=generator) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=generator) * 1.5, -1)
    for n in sizes:
        freq = first_token_frequencies(p, q, k, n, seed=n)
        # Within 5 standard errors of p, a bound that shrinks as 1/sqrt(n).
        bound = 5 * (p[0] * (1 - p[0]) / n).sqrt() + 1e-9
        assert ((freq - p[0]).abs() <= bound).all(), (freq, p[0], bound)


def test_greedy_drafts_verified_as_one_hot_keep_the_target_distribution():
    """vLLM's default draft_sample_method: the drafter's argmax, verified as a one-hot q. The output is
    still distributed as p whichever token the drafter insists on."""
    generator = torch.Generator().manual_seed(2)
    p = torch.softmax(torch.randn(3, 6, generator=generator) * 1.5, -1)
    n = 200_000
    bound = 5 * (p[0] * (1 - p[0]) / n).sqrt()
    for insisted in (int(p[0].argmax()), int(p[0].argmin())):
        one_hot = torch.nn.functional.one_hot(torch.tensor([insisted, 1]), 6).float()
        freq = first_token_frequencies(p, one_hot, 2, n, seed=insisted)
        assert ((freq - p[0]).abs() <= bound).all(), (insisted, freq, p[0])


def test_the_distribution_bound_catches_a_verifier_that_accepts_every_draft():
    """The same measurement through verify_random, with the uniform draws forced to 0 so every draft is
    accepted (a verifier that ignores p): the first token then follows q and lands outside the bound."""
    generator = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 6, generator=generator) * 1.5, -1)
    q = torch.softmax(torch.randn(1, 6, generator=generator) * 1.5, -1)
    n = 200_000
    drafts = torch.multinomial(q[0].expand(n, -1), 1, replacement=True, generator=generator)
    _, emitted = verify_random(drafts, q.expand(n, -1, -1), p.expand(n, -1, -1), torch.zeros(n, 1), generator)
    freq = torch.bincount(emitted[:, 0], minlength=6).float() / n
    bound = 5 * (p[0] * (1 - p[0]) / n).sqrt()
    assert ((freq - p[0]).abs() > bound).any()
    torch.testing.assert_close(freq, q[0], atol=0.01, rtol=0)  # it measured q: the verifier it stands for


def test_identical_draft_and_target_accept_everything():
    p = torch.softmax(torch.randn(4, 3, 10), -1)
    drafts = torch.multinomial(p[:, :2].reshape(-1, 10), 1).view(4, 2)
    accepted, emitted = verify_random(drafts, p[:, :2], p, torch.rand(4, 2), None)
    assert accepted.tolist() == [2, 2, 2, 2]
    assert (emitted[:, :2] == drafts).all() and (emitted[:, 2] >= 0).all()


def test_probability_processing_top_k_top_p_and_temperature():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    top_k = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (top_k[0, 2:] == 0).all() and torch.isclose(top_k.sum(), torch.tensor(1.0))
    full = probabilities(logits, SamplingParams(temperature=1.0))
    top_p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    kept = int((top_p > 0).sum())
    assert full[0, : kept - 1].sum() < 0.8 <= full[0, :kept].sum()
    cold = probabilities(logits, SamplingParams(temperature=0.1))
    assert cold[0, 0] > 0.99
