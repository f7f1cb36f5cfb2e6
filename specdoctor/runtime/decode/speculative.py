"""The speculative step, top to bottom: propose, verify, accept, commit.

Vocabulary (docs/engine-semantics.md §Verification): q is the drafter's distribution, p the
target's. The drafter proposes k tokens; the target scores the pending token and the k drafts in
one pass; draft j is *accepted* while it passes; at the first failure the target's *recovered*
token replaces it and the step ends; if all k pass, the target's distribution after the last draft
gives a *bonus* token. A step therefore emits accepted + 1 tokens. The last pipeline rank runs
`Drafts.propose` and `speculative_step`; every rank runs `commit` on the decision it broadcasts.
"""

from __future__ import annotations

import time

import torch

from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.cache.regroup import joined_rows
from specdoctor.runtime.compile import LayerGraphs
from specdoctor.runtime.decode.grammar import real_draft
from specdoctor.runtime.decode.rejection import PLACEHOLDER, verify_greedy, verify_random
from specdoctor.runtime.faults import Faults
from specdoctor.runtime.sampling import RowSampler, SamplingParams, greedy_tokens, probabilities, sample

DUMMY_DRAFT = 0  # vLLM's stand-in draft where the drafter does not run: an ordinary token id


def finish_device_work(device: torch.device) -> None:
    """CUDA runs ahead of the host: wait for it, so each phase's time is its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Drafts:
    """The last rank's proposals: tokens [B, k] and, when a row samples, their distributions q [B, k, V]."""

    def __init__(
        self, drafter, cache: KVCache, k: int, sampler: RowSampler, sampled_drafts: bool, device, faults=Faults()
    ):
        self.drafter, self.cache, self.k = drafter, cache, k
        self.sampler, self.sampled_drafts, self.faults = sampler, sampled_drafts, faults
        self.tokens = torch.zeros(cache.batch, 0, dtype=torch.long, device=device)
        self.probs: torch.Tensor | None = None
        self.seconds = 0.0  # time spent proposing, for the step profile
        self.stale_inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # --fault stale-batch-rows
        self.decoding = False  # past the prompt pass's proposal (a regrouped batch is)
        self.kept_logits: torch.Tensor | None = None  # [B, k, V] the drafts' logits (--fault logprobs-of-draft)

    def propose(
        self,
        next_tokens: torch.Tensor,  # [B, T] the token after each position
        features: torch.Tensor,  # [B, T, ...] what the drafter reads: the final-normed states, or the taps
        positions: torch.Tensor,  # [B, T]
        base: torch.Tensor,  # [B] index of the last accepted position: the drafts continue from there
    ) -> None:
        """k drafts from the drafter's chain (MTP steps, or a DSpark block's Markov walk): each position's
        logits give a draft, which the drafter is handed back before it gives the next position's."""
        start = time.perf_counter()
        if self.faults.stale_batch_rows:
            next_tokens, features = self._stale_rows(next_tokens, features)
        if self.past_dummy_limit(positions, base):
            self._dummy(next_tokens.shape[0], next_tokens.device)  # vLLM's length gate: the drafter does not run
        elif (
            self.sampler.all_greedy
            and isinstance(self.drafter.greedy_chain, LayerGraphs)
            and not self.faults.logprobs_of_draft
        ):
            # Every draft an argmax, the chain compiled: one graph for the whole chain (runtime/compile.py).
            self.tokens = self.drafter.greedy_drafts(next_tokens, features, positions, base, self.cache, self.k)
            self.probs = None
        else:
            chain = self.drafter.draft(next_tokens, features, positions, base, self.cache, self.k)
            logits = next(chain)
            tokens, probs, kept = [], [], []
            for step in range(self.k):
                token, q = self._pick(logits)  # [B], [B, V] or None
                tokens.append(token)
                probs.append(q)
                kept.append(logits)
                if step + 1 < self.k:
                    logits = chain.send(token)
            self.tokens = torch.stack(tokens, dim=1)
            self.kept_logits = torch.stack(kept, dim=1) if self.faults.logprobs_of_draft else None
            self.probs = None if self.sampler.all_greedy else torch.stack(probs, dim=1)
        finish_device_work(self.tokens.device)
        self.seconds += time.perf_counter() - start

    def fill(self, next_tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, base: torch.Tensor):
        """No drafts (the next step decodes plainly), but the drafter's cache kept as `propose` keeps it: only the
        entries at these positions where the drafter can store them alone, else its whole proposal, dropped."""
        if not self.drafter.fills_cache_only:
            self.propose(next_tokens, features, positions, base)
        else:
            start = time.perf_counter()
            self.drafter.fill(next_tokens, features, positions, self.cache)
            finish_device_work(next_tokens.device)
            self.seconds += time.perf_counter() - start
        self._dummy(next_tokens.shape[0], next_tokens.device)  # what a row verifies if made to speculate next

    def next_drafts(self, propose: bool, next_tokens, features, positions, base) -> torch.Tensor:
        """The drafts [B, k] the next step verifies: proposed, or PLACEHOLDER where it decodes plainly (the drafter's
        cache only filled)."""
        if propose:
            self.propose(next_tokens, features, positions, base)
            return self.tokens
        self.fill(next_tokens, features, positions, base)
        return torch.full_like(self.tokens, PLACEHOLDER)

    def past_dummy_limit(self, positions: torch.Tensor, base: torch.Tensor) -> bool:
        """vLLM's length gate (--fault drafter-max-position, a draft model's dummy policy): the batch's longest
        sequence (its last accepted position, not padding) plus k past the limit. Read from the device only when
        there is a limit: it waits for the device."""
        limit = self.faults.drafter_max_position
        return limit is not None and int(positions.gather(1, base[:, None]).max()) + 1 + self.k > limit

    def _dummy(self, batch: int, device) -> None:
        """DUMMY_DRAFT at every position of every row (no q: verified as one-hot, as greedy drafts are)."""
        self.tokens = torch.full((batch, self.k), DUMMY_DRAFT, dtype=torch.long, device=device)
        self.probs = None
        self.kept_logits = None

    def _stale_rows(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows after the first keep reading the input (tokens and features) of the first decode step this batch
        took: a drafter buffer written once and never refreshed (the batch regrouped, it is written again)."""
        stale = self.stale_inputs
        if tokens.shape[0] < 2 or not self.decoding:
            return tokens, features
        if stale is None or stale[0].shape != tokens.shape or stale[1].shape != features.shape:
            self.stale_inputs = tokens, features
            return tokens, features
        return torch.cat([tokens[:1], stale[0][1:]]), torch.cat([features[:1], stale[1][1:]])

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits: [B, V]
        """A draft token [B] and, when a row samples, the q [B, V] it is verified against (unused for greedy rows)."""
        tokens = greedy_tokens(logits)
        if self.sampler.all_greedy:
            return tokens, None
        # vLLM's default: the drafter's argmax, verified as if q were one-hot on it (accepted when
        # u <= p(x); on rejection the recovered token comes from p with x removed).
        q = one_hot(tokens, logits.shape[-1])
        if self.sampled_drafts:
            for row in self.sampler.sampled_rows:
                q[row] = probabilities(logits[row], self.sampler.params[row])
                tokens[row] = sample(q[row : row + 1], self.sampler.generators[row])[0]
        return tokens, q

    def regroup(self, sources: list["Drafts"], rows: list[int] | None, sampler: RowSampler) -> "Drafts":
        """A Drafts over these sources' rows, concatenated in order, then `rows` of them (None: all),
        with the batch's regrouped sampler."""
        cache = KVCache.regroup([d.cache for d in sources], rows)
        joined = Drafts(self.drafter, cache, self.k, sampler, self.sampled_drafts, self.tokens.device, self.faults)
        joined.tokens = joined_rows([d.tokens for d in sources], rows)
        if any(d.probs is not None for d in sources):
            vocab = next(d.probs.shape[-1] for d in sources if d.probs is not None)
            probs = [d.probs if d.probs is not None else one_hot(d.tokens, vocab) for d in sources]
            joined.probs = joined_rows([p.float() for p in probs], rows)
        joined.seconds = sum(d.seconds for d in sources)
        joined.decoding = True
        return joined


RAW = SamplingParams(temperature=1.0)  # the target's own distribution, untempered and untruncated


def one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The q of drafts that were not sampled: all mass on the draft ([...] -> [..., V])."""
    return torch.nn.functional.one_hot(tokens, vocab).to(torch.float32)


def verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor, drafts: "Drafts | None", sampler: RowSampler):
    """(accepted [B], emitted [B, k+1]): greedy rows by argmax, each sampled row by rejection sampling with
    its own parameters and generator."""
    accepted, emitted = verify_greedy(draft_tokens, target_logits)
    for row in sampler.sampled_rows:
        one = slice(row, row + 1)
        generator = sampler.generators[row]
        ignored = drafts is not None and drafts.faults.sampling_params_ignored
        p = probabilities(target_logits[one], RAW if ignored else sampler.params[row])  # [1, k+1, V]
        if drafts is None:
            q = p[:, :0]  # [1, k, V]: k is 0
        else:  # drafts without a q (dummy drafts) are verified as greedy ones are
            q = drafts.probs[one] if drafts.probs is not None else one_hot(draft_tokens[one], p.shape[-1])
        uniform = torch.rand(draft_tokens[one].shape, generator=generator, device=target_logits.device)
        reuse = drafts is not None and drafts.faults.rejection_reuse_uniform
        row_accepted, row_emitted = verify_random(draft_tokens[one], q, p, uniform, generator, reuse)
        accepted[one], emitted[one] = row_accepted, row_emitted
    return accepted, emitted


def speculative_step(
    target_logits: torch.Tensor,  # [B, k+1, V] p's logits at the pending token and each draft
    features: torch.Tensor,  # [B, k+1, ...] what the drafter reads at the same positions (Drafts.propose)
    positions: torch.Tensor,  # [B, k+1]
    drafts: Drafts | None,  # None for plain decoding (k = 0)
    sampler: RowSampler,
    propose: bool = True,  # False: the next step decodes plainly; the drafter only keeps its cache
) -> torch.Tensor:
    """The last rank's step. Returns the decision every rank commits, [B, 2k+2]: accepted count n,
    the emitted tokens (n accepted drafts, then one recovered or bonus token; padded), the next k drafts."""
    batch = target_logits.shape[0]
    draft_tokens = drafts.tokens if drafts else target_logits.new_zeros(batch, 0, dtype=torch.long)  # [B, k]
    # Verify: accept the longest passing prefix, then one recovered or bonus token from p.
    accepted, emitted = verify(draft_tokens, target_logits, drafts, sampler)
    # Propose the next drafts: the MTP input at position L+j is token L+j+1, i.e. the accepted drafts,
    # then the newly emitted token at index n; the chain continues from the last accepted position.
    if drafts:
        new_token = emitted.gather(1, accepted[:, None])  # [B, 1]
        next_tokens = torch.cat([draft_tokens, new_token], dim=1).scatter(1, accepted[:, None], new_token)
        draft_tokens = drafts.next_drafts(propose, next_tokens, features, positions, base=accepted)
    return torch.cat([accepted[:, None], emitted, draft_tokens], dim=1)


def append_run(result, row: int, run: list[int], sequence, stop_in_draft_missed: bool) -> None:
    """Append a step's emitted tokens up to a stop token id (kept apart, in `stop_tokens`) or the sequence's
    limit; with the fault, a stop id is seen only as the run's last token."""
    for index, token in enumerate(run):
        if token in sequence.stop_token_ids and (index == len(run) - 1 or not stop_in_draft_missed):
            result.finish_reasons[row], result.stop_tokens[row] = "stop", token
            return
        result.tokens[row].append(token)
        if len(result.tokens[row]) >= sequence.max_new_tokens:
            result.finish_reasons[row] = "length"
            return


def commit(
    result,
    decision: list[list[int]],
    k: int,
    sequences,
    counted: list[bool],
    active=None,
    faults=Faults(),
    drafted: list[int] | None = None,
):
    """Append each active sequence's emitted tokens, stopping at one of its stop token ids or its limit;
    returns which rows go on. decision: the step's, read to the host; its rows: [accepted n, emitted tokens (k+1,
    padded), next drafts (k)]. `counted`: the rows whose drafts the metrics count; `drafted`: how many drafts each
    verified (k, or fewer where a grammar cut them: a step that verified none is no draft, as vLLM counts it).
    `faults`: the two that break this (stop-in-draft-missed, eos-leak-past-max-tokens)."""
    active = active or [True] * len(result.tokens)
    still = []
    for row, (n, *rest) in enumerate(decision):
        if not active[row]:
            still.append(False)
            continue
        verified = k if drafted is None else drafted[row]
        if counted[row] and verified:
            result.metrics.record(n, verified, k)
            result.row_metrics[row].record(n, verified, k)
        sequence, run = sequences[row], rest[: n + 1]
        if faults.eos_leak_past_max_tokens and len(result.tokens[row]) + len(run) > sequence.max_new_tokens:
            result.tokens[row] += run  # the run that crosses the limit, whole: past it, and past any stop in it
            result.finish_reasons[row] = "length"
        else:
            append_run(result, row, run, sequence, faults.stop_in_draft_missed)
        still.append(not result.finish_reasons[row])
        if still[-1]:
            result.proposals += [real_draft(token) for token in rest[k + 1 :]]  # the drafter's, a grammar's cut too
    return still
