"""DeepSeek Sparse Attention's choice of keys (runtime/models/dsa.py) where it really selects (`index_topk` below
the context): ties go to the earlier position; a query keeps the same keys whether it is decoded alone,
verified among k+1 queries or read in a prompt pass; the boundary gap; and transformers' own classes as the
oracle where the selection is unambiguous (docs/engine-semantics.md §DSA tie order)."""

from __future__ import annotations

import pytest
import torch

from specdoctor.runtime.models.dsa import boundary_gaps, index_scores, top_keys
from tests.helpers.reference_decoder import greedy_generate
from tests.helpers.sparse_attention import (
    DSA_ARCHITECTURES,
    TIED,
    make_tied_checkpoint,
    prompt_scores,
    whole_target,
)

LENGTH = 32  # the prompt pass's length: several times TIED's index_topk


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """{architecture: (directory, transformers model)} with TIED's indexer."""
    made = {}
    for architecture in DSA_ARCHITECTURES:
        path = tmp_path_factory.mktemp(architecture)
        made[architecture] = path, make_tied_checkpoint(path, architecture)
    return made


def reference_top_keys(scores: list[float], topk: int) -> set[int]:
    """The rule, written out: best score first, the earlier position first among equal scores."""
    return set(sorted(range(len(scores)), key=lambda t: (-scores[t], t))[:topk])


def test_ties_go_to_the_earlier_position_and_minus_zero_is_zero():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (6, 40), generator=generator).double()  # four values: ties everywhere
    scores[:, 30:] = float("-inf")  # not causal
    for row, chosen in enumerate(top_keys(scores, 9).tolist()):
        assert set(chosen) == reference_top_keys(scores[row].tolist(), 9)
    q, keys = torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([[[-1.0, 0.0], [-2.0, 0.0]]])  # both dot products < 0
    zeros = index_scores(q, keys, torch.tensor([[[-1.0]]]))  # a negative head weight times relu's 0: -0.0
    assert zeros.tolist() == [[[0.0, 0.0]]] and not zeros.signbit().any()


def test_boundary_gap_is_the_kth_score_minus_the_next():
    scores = torch.tensor([[3.0, 1.0, 2.0, 2.0, float("-inf")], [5.0, 4.0, float("-inf"), float("-inf"), 1.0]])
    assert boundary_gaps(scores.double(), 2).tolist() == [0.0, 3.0]  # row 0: 3, 2 | 2 (a tie)
    assert boundary_gaps(scores.double(), 3).tolist() == [1.0, float("inf")]  # row 1: only 3 causal keys
    assert boundary_gaps(scores.double(), 5).tolist() == [float("inf")] * 2


@pytest.mark.parametrize("architecture", DSA_ARCHITECTURES)
@torch.no_grad()
def test_a_query_keeps_the_same_keys_in_every_pass_shape(tied, architecture):
    """Each layer's indexer inputs from one prompt pass, cut to the passes the runtime makes: the query alone
    over its causal span (a target-only step), and first of 4 queries over a span 3 longer (a verify pass at
    k 3). From the same q, k and head weights its scores agree to float64 rounding, and it keeps the keys the
    prompt pass gave it (by the rule: ties at its top-k boundary to the earlier key), also when the indexer
    computes q and the weights again in the cut pass."""
    stage = whole_target(tied[architecture][0])
    ids = torch.randint(0, 320, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    calls = prompt_scores(stage, ids)
    topk, tied_boundaries = TIED["index_topk"], 0
    for indexer, (x, q_latent, (cos, sin), keys, mask), scores in calls:
        whole = indexer.select(x, q_latent, (cos, sin), keys, mask)[0, 0]  # [T, S]
        q, weights = indexer.queries(x, q_latent, (cos, sin))
        tied_boundaries += int((boundary_gaps(scores, topk) == 0).sum())
        for p in range(topk, LENGTH - 3):
            assert set(whole[p].nonzero()[:, 0].tolist()) == reference_top_keys(scores[0, p].tolist(), topk)
            for queries, span in ((1, p + 1), (4, p + 4)):
                cut = slice(p, p + queries)
                alone = index_scores(q[:, cut], keys[:, :span, 0], weights[:, cut])[0, 0]
                assert alone.dtype == torch.float64
                assert torch.allclose(alone[: p + 1], scores[0, p, : p + 1], rtol=0, atol=1e-12)  # scores ~1
                chosen = top_keys(alone.masked_fill(~mask[0, 0, p, :span], float("-inf")), topk)
                assert set(chosen.tolist()) == set(whole[p].nonzero()[:, 0].tolist()), (p, queries)
                args = x[:, cut], q_latent[:, cut], (cos[:, cut], sin[:, cut]), keys[:, :span], mask[:, :, cut, :span]
                assert torch.equal(indexer.select(*args)[0, 0, 0], whole[p, :span]), (p, queries)
    assert tied_boundaries >= 5  # the premise: ties do fall on the boundary


@pytest.mark.parametrize("architecture", DSA_ARCHITECTURES)
def test_prompt_pass_predicts_what_the_cached_decode_emitted(tied, architecture):
    """Teacher forcing: the cache-less forward over prompt + continuation picks, at every position, the token
    the KV-cached decode (one query a step) emitted. transformers' own classes do not on such a model: their
    torch.topk orders tied keys by the row's length (docs/engine-semantics.md §DSA tie order)."""
    path, model = tied[architecture]
    stage = whole_target(path)
    prompt = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    continuation = greedy_generate(stage, [prompt], 16)[0]
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        forced = stage.logits(stage(ids, torch.arange(ids.shape[1])[None]))[0, len(prompt) - 1 : -1].argmax(-1)
    assert forced.tolist() == continuation


@pytest.mark.parametrize("architecture", DSA_ARCHITECTURES)
def test_logits_match_transformers_where_the_selection_is_unambiguous(tmp_path, architecture):
    """index_topk 4 of up to 32 keys, the configs' default indexer heads (no exact zeros): every query's
    boundary gap is far above float32 rounding, so any correct top-k picks the same keys, and the logits at every
    position match transformers'."""
    model = make_tied_checkpoint(tmp_path, architecture, seed=3, index_topk=4, index_n_heads=16)
    stage = whole_target(tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(4))
    calls = prompt_scores(stage, ids)
    assert len(calls) == model.config.num_hidden_layers
    for _, _, scores in calls:
        gaps = boundary_gaps(scores, 4)
        scale = scores[scores > float("-inf")].abs().max()
        assert (gaps[:, 4:] > 1e-5 * scale).all()  # queries 4.. keep 4 of more; float32 rounds at ~1e-7
    with torch.no_grad():
        ours, expected = stage.logits(stage(ids, torch.arange(LENGTH).expand(2, -1))), model(ids).logits
    assert float((ours - expected).abs().max() / expected.abs().max()) < 1e-4
