"""A batch of prompts decoded across pipeline ranks, with or without MTP speculative decoding.

Every rank runs `decode_batch` in lockstep. Tokens are known to all ranks (the last rank broadcasts
each step's decision); only hidden states travel rank to rank. The last rank verifies drafts,
proposes the next ones and decides (runtime/decode/speculative.py); every other rank learns from that
broadcast how many tokens were accepted, so positions and KV caches stay in sync on all of them.
"""

from __future__ import annotations

import time

import torch

from specdoctor.runtime.cache.kv_cache import KVCache
from specdoctor.runtime.cache.prefix import BLOCK_SIZE, block_hashes
from specdoctor.runtime.cache.regroup import joined_rows
from specdoctor.runtime.comm import PipelineComm
from specdoctor.runtime.decode.adjustments import adjusted_logits
from specdoctor.runtime.decode.grammar import RowGrammars, batch_grammars, real_drafts, verified_counts
from specdoctor.runtime.decode.logprobs import TokenLogprob, emitted_logprobs, prompt_logprobs
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.decode.pipeline import RankModel, pad_right, pipeline_pass
from specdoctor.runtime.decode.rejection import PLACEHOLDER
from specdoctor.runtime.decode.requests import (
    STEP_PHASES,
    GenerateRequest,
    GenerateResult,
    SequenceRequest,
    validate_request,
)
from specdoctor.runtime.decode.speculative import DUMMY_DRAFT, Drafts, commit, finish_device_work, speculative_step
from specdoctor.runtime.options import DraftSampleMethod
from specdoctor.runtime.sampling import RowSampler


class BatchState:
    """One batch's decoding state on one rank: its caches, the last decision and how far each row got.
    Rows can join (`regroup` of a running batch and a prefilled one) and leave (`regroup` with rows)."""

    def __init__(self, model: RankModel, sequences: list[SequenceRequest], k: int, sampled_drafts: bool = False):
        self.model, self.sequences, self.k = model, sequences, k
        self.ids, self.lengths = pad_right([s.prompt for s in sequences], model.device)
        batch = len(sequences)
        # With prefix caching, each prompt's leading blocks found in the store (the prompt pass starts past them).
        store = model.prefix_store
        self.hashes = [block_hashes(s.prompt) if store else [] for s in sequences]
        # A prompt whose log-probabilities are asked for is computed whole, as vLLM computes it (no cached blocks).
        hits = [
            store.hits(hashes, drafter=bool(k)) * BLOCK_SIZE if store and s.prompt_logprobs is None else 0
            for s, hashes in zip(sequences, self.hashes, strict=True)
        ]
        self.cached = torch.tensor(hits, device=model.device)
        pass_end = int(self.cached.max()) + int((self.lengths - self.cached).max())  # a padded pass writes to here
        # An active row has filled <= prompt + max_new - 2; a step writes up to k + (k - 1) positions past it.
        max_len = pass_end + max(s.max_new_tokens for s in sequences) + 2 * k
        self.cache = model.cache(batch, max_len)
        self.sampler, self.drafts, self.grammars = None, None, None
        if model.placement.is_last:
            self.sampler = RowSampler([s.sampling for s in sequences], model.device)
            self.grammars = batch_grammars(model, sequences, k)
            if k:
                drafter_cache = model.cache(batch, max_len, drafter=True)
                self.drafts = Drafts(
                    model.drafter, drafter_cache, k, self.sampler, sampled_drafts, model.device, model.faults
                )
        self.result = GenerateResult([[] for _ in range(batch)], [""] * batch)
        self.result.row_metrics = [SpecMetrics() for _ in range(batch)]
        self.result.logprobs = [[] for _ in range(batch)]
        self.result.cached_tokens = hits
        self.result.prompt_logprobs = [None] * batch
        self.pending_logprobs: dict[int, list[TokenLogprob]] = {}  # the last step's, until committed
        self.decision = torch.empty(batch, 2 * k + 2, dtype=torch.long, device=model.device)
        self.filled = self.lengths.clone()  # positions [0, filled) hold valid KV entries on every rank
        self.active = [True] * batch
        self.speculating = False  # every row's pending decision holds drafts: the next step verifies them
        self.stepped_speculatively = False
        self.stand_in_drafts = [False] * batch  # rows whose drafts the next step verifies are DUMMY_DRAFT (regroup)
        self.verified: torch.Tensor | None = None  # [B] the drafts the last step verified, where a grammar cut some

    def commit(self, count_metrics: bool) -> None:
        before, was_active = [len(tokens) for tokens in self.result.tokens], self.active
        counted = [count_metrics and self.stepped_speculatively and not dummy for dummy in self.stand_in_drafts]
        if self.verified is None:  # no grammar cut this step's drafts: each row verified k
            decision, drafted = self.decision.tolist(), None  # the step's one read from the device
        else:
            read = torch.cat([self.decision, self.verified[:, None]], dim=1).tolist()  # one read all the same
            decision, drafted = [row[:-1] for row in read], [row[-1] for row in read]
        self.active = commit(
            self.result, decision, self.k, self.sequences, counted, self.active, self.model.faults, drafted
        )
        self.stand_in_drafts = [False] * len(self.sequences)
        self.speculating = self.k > 0 and all(PLACEHOLDER not in row[self.k + 2 :] for row in decision)
        for row, entries in self.pending_logprobs.items():  # the emitted tokens' entries, in order, and a stop's
            # a row active until this commit that has a stop token got it now (it ends the row)
            stopped_now = was_active[row] and self.result.stop_tokens[row] is not None
            self.result.logprobs[row] += entries[: len(self.result.tokens[row]) - before[row] + stopped_now]
        self.pending_logprobs = {}

    def note_logprobs(self, logits: torch.Tensor) -> None:
        """On the last rank, before the commit: the log-probabilities of this step's emitted tokens."""
        wanted = {row: s.logprobs for row, s in enumerate(self.sequences) if s.logprobs is not None}
        if wanted:
            emitted = self.decision[:, 1 : 1 + logits.shape[1]]  # [B, T]: emitted token j came from position j
            self.pending_logprobs = emitted_logprobs(logits, emitted, wanted)

    def note_prompt_logprobs(self, final: torch.Tensor) -> None:
        """On the last rank, in the prompt pass: the prompt's log-probabilities for each row that asked (its pass
        started at position 0: no cached blocks), each position's logits computed there alone."""
        for row, sequence in enumerate(self.sequences):
            if sequence.prompt_logprobs is not None:
                length = len(sequence.prompt)
                logits = self.model.stage.lm_head(final[row : row + 1, : length - 1])[0]  # [L - 1, V]
                entries = prompt_logprobs(logits, self.ids[row, 1:length], sequence.prompt_logprobs)
                self.result.prompt_logprobs[row] = entries

    def prefill(self) -> None:
        """The prompts through every rank (past their cached blocks); the last rank picks the first token and the
        first drafts. With prefix caching, the prompts' blocks are kept for later prompts."""
        model, batch = self.model, len(self.sequences)
        computed = self.lengths - self.cached  # each prompt's tokens this pass computes (at least its last)
        positions = self.cached[:, None] + torch.arange(int(computed.max()), device=model.device)  # [B, T]
        ids = self.ids.gather(1, positions.clamp(max=self.ids.shape[1] - 1))  # padding reads a real id, then is masked
        if model.prefix_store:
            unwritten = "drafter" if model.faults.prefix_cache_drafter_kv else None
            for row, hashes in enumerate(self.hashes):
                hit = hashes[: self.result.cached_tokens[row] // BLOCK_SIZE]  # the host's copy: no device read
                model.prefix_store.restore(self.cache_roles(), row, hit, unwritten)
        self.cache.begin(valid_end=computed, keep_positions=False)
        hidden, taps = pipeline_pass(model, ids, positions, self.cache)
        self.cache.commit(computed - 1, torch.ones(batch, dtype=torch.bool, device=model.device))
        if model.placement.is_last:
            rows, last = torch.arange(batch, device=model.device), computed - 1
            final = model.stage.model.norm(hidden)  # [B, T, H]: an MTP drafter is fed the final-normed states
            self.note_prompt_logprobs(final)
            logits = self.constrained(model.stage.lm_head(final[rows, last][:, None]), None)  # [B, 1, V]: the last's
            first = speculative_step(self.adjusted(logits, None), None, None, None, self.sampler)  # [B, 2]
            self.decision.fill_(PLACEHOLDER)
            self.decision[:, :2] = first
            self.note_logprobs(logits)
            if self.drafts:
                # The MTP input at each prompt position is the next token: the prompt's, then the first new one.
                next_tokens = torch.cat([ids[:, 1:], ids[:, :1]], dim=1).scatter(1, last[:, None], first[:, 1:2])
                self.drafts.propose(next_tokens, model.drafter_features(ids, final, taps), positions, base=last)
                self.drafts.decoding = True
                self.decision[:, self.k + 2 :] = self.drafts.tokens
            self.decision = self.grammar_cut(self.decision)
        if model.prefix_store:
            for row, hashes in enumerate(self.hashes):
                model.prefix_store.save(self.cache_roles(), row, hashes, drafter=bool(self.k))
        model.comm.broadcast_from_last(self.decision)
        self.commit(count_metrics=False)

    def cache_roles(self) -> dict[str, KVCache]:
        """The caches prefix caching keeps blocks of: this rank's, and the drafter's on its rank."""
        return {"target": self.cache, **({"drafter": self.drafts.cache} if self.drafts else {})}

    def step(self, propose_next: bool = True) -> None:
        """Verify the pending token and the drafts in one pipeline pass (the pending token alone where the last
        step proposed none); every rank commits the decision. `propose_next`, read on the last rank: whether this
        step proposes drafts for the next one, or only keeps the drafter's cache whole (the next step is plain)."""
        model, k, decision = self.model, self.k, self.decision
        speculate = self.speculating
        tokens = decision.gather(1, 1 + decision[:, :1])
        drafted, self.verified = decision[:, k + 2 :], None
        if speculate and any(sequence.grammar is not None for sequence in self.sequences):  # some may be cut
            drafted, self.verified = real_drafts(drafted), verified_counts(drafted)
        if speculate:
            tokens = torch.cat([tokens, drafted], dim=1)
        positions = self.filled[:, None] + torch.arange(tokens.shape[1], device=model.device)  # [B, T]
        self.cache.begin(valid_end=None, keep_positions=True)  # the accepted count is known only after
        hidden, taps = pipeline_pass(model, tokens, positions, self.cache)
        if model.placement.is_last:
            final, logits = model.stage.head(hidden)
            logits = self.constrained(logits, drafted if speculate else None)
            features = model.drafter_features(tokens, final, taps)  # what the drafter reads
            reported = self.reported_logits(logits) if speculate else logits  # before the next proposal
            if speculate:
                chosen_from = self.adjusted(logits, drafted)
                drafts, sampler = self.drafts, self.sampler
                self.decision = speculative_step(chosen_from, features, positions, drafts, sampler, propose_next)
            else:
                self.decision = self.plain_decision(logits, features, positions, propose_next)
            self.decision = self.grammar_cut(self.decision)
            self.note_logprobs(reported)
        model.comm.broadcast_from_last(self.decision)
        self.stepped_speculatively = speculate
        finish_device_work(model.device)

    def constrained(self, logits: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
        """The target's logits with structured output's masks (runtime/decode/grammar.py); `drafts` [B, k]: those
        this step verifies (None: a plain step). Log-probabilities are read after the mask, as vLLM's are."""
        if self.grammars is None or not self.grammars.active:
            return logits
        return self.grammars.constrain(logits, drafts, self.active)

    def grammar_cut(self, decision: torch.Tensor) -> torch.Tensor:
        """On the last rank, before the broadcast: structured output's matchers past the step's emitted tokens, and
        the next drafts after their longest valid prefix cut (runtime/decode/grammar.py)."""
        if self.grammars is None or not self.grammars.active:
            return decision
        return self.grammars.advance_and_cut(decision, self.k, self.active)

    def adjusted(self, logits: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
        """The logits each row's tokens are chosen from: its penalties, logit_bias and min_tokens applied
        (runtime/decode/adjustments.py); `drafts` [B, k]: those this step verifies (None: a plain step)."""
        faulty = self.model.faults.penalties_per_step
        return adjusted_logits(logits, self.sequences, self.result.tokens, drafts, per_step=faulty)

    def reported_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits a speculative step's log-probabilities are read from: the target's; with --fault
        logprobs-of-draft, the drafter's at the drafts' positions (what proposed them), the target's after."""
        drafted = self.drafts.kept_logits if self.drafts else None
        if drafted is None or drafted.shape[-1] != logits.shape[-1]:
            return logits
        return torch.cat([drafted.to(logits.dtype), logits[:, drafted.shape[1] :]], dim=1)

    def plain_decision(self, logits, features, positions, propose: bool) -> torch.Tensor:
        """A plain step's decision: none accepted, the next token, and the drafts from it (or none)."""
        first = speculative_step(self.adjusted(logits, None), None, None, None, self.sampler)  # [B, 2]
        decision = torch.full_like(self.decision, PLACEHOLDER)
        decision[:, :2] = first
        if self.drafts:
            base = torch.zeros_like(first[:, 0])  # the one position
            decision[:, self.k + 2 :] = self.drafts.next_drafts(propose, first[:, 1:], features, positions, base)
        return decision

    def stand_in_plain_rows(self) -> None:
        """A seeded row joined rows decoding plainly: the next step speculates anyway, as the row does alone, and
        the plain rows verify DUMMY_DRAFT (what their drafter left: Drafts.fill), left out of the metrics."""
        k, drafts = self.k, self.decision[:, self.k + 2 :]
        plain = (drafts == PLACEHOLDER).all(dim=1)
        self.decision[:, k + 2 :] = torch.where(plain[:, None], DUMMY_DRAFT, drafts)
        self.stand_in_drafts, self.speculating = plain.tolist(), True

    def advance(self) -> None:
        # Finished rows stay in the batch but stop advancing, so they never outgrow the KV cache.
        still = torch.tensor(self.active, device=self.model.device)
        self.cache.commit(self.decision[:, 0], still)  # recurrent states: after the last accepted token
        self.filled = torch.where(still, self.filled + self.decision[:, 0] + 1, self.filled)

    @staticmethod
    def regroup(batches: list["BatchState"], rows: list[int] | None = None) -> "BatchState":
        """One batch of these batches' rows, concatenated in order, then `rows` of them (None: all).
        Only state that lives past the prompt pass is kept (the prompt ids are not)."""
        first = batches[0]
        joined = BatchState.__new__(BatchState)
        joined.model, joined.k = first.model, first.k
        sequences = [s for b in batches for s in b.sequences]
        joined.sequences = sequences if rows is None else [sequences[r] for r in rows]
        joined.cache = KVCache.regroup([b.cache for b in batches], rows)
        joined.sampler = RowSampler.join([b.sampler for b in batches], rows) if first.sampler else None
        joined.drafts = (
            first.drafts.regroup([b.drafts for b in batches], rows, joined.sampler) if first.drafts else None
        )
        joined.grammars = RowGrammars.join([b.grammars for b in batches], rows) if first.grammars else None
        joined.decision = joined_rows([b.decision for b in batches], rows)
        joined.filled = joined_rows([b.filled for b in batches], rows)
        keep = range(len(sequences)) if rows is None else rows

        def kept(values: list) -> list:
            return [values[r] for r in keep]

        joined.active = kept([a for b in batches for a in b.active])
        joined.speculating = all(b.speculating for b in batches)
        joined.stepped_speculatively = False
        joined.stand_in_drafts = [False] * len(joined.sequences)
        joined.verified = None
        if not joined.speculating and joined.k and any(sequence.sampling.seeded for sequence in joined.sequences):
            joined.stand_in_plain_rows()
        joined.result = GenerateResult(
            kept([t for b in batches for t in b.result.tokens]),
            kept([f for b in batches for f in b.result.finish_reasons]),
        )
        joined.result.row_metrics = kept([m for b in batches for m in b.result.row_metrics])
        joined.result.logprobs = kept([entries for b in batches for entries in b.result.logprobs])
        joined.result.cached_tokens = kept([n for b in batches for n in b.result.cached_tokens])
        joined.result.prompt_logprobs = kept([p for b in batches for p in b.result.prompt_logprobs])
        joined.result.stop_tokens = kept([t for b in batches for t in b.result.stop_tokens])
        joined.pending_logprobs = {}
        joined.ids = joined.lengths = None
        return joined


@torch.no_grad()
def decode_batch(model: RankModel, request: GenerateRequest, on_step=None) -> GenerateResult:
    """Run one batch of prompts to completion; every rank returns the same result.
    `on_step(result)` sees the result as it grows, after every step (for streaming)."""
    validate_request(request, model.stage.config, model.speculates)
    sampled_drafts = request.draft_sample_method == DraftSampleMethod.PROBABILISTIC
    state = BatchState(model, request.sequences(), request.num_speculative_tokens, sampled_drafts)
    times = dict.fromkeys(STEP_PHASES, 0.0)
    started = time.perf_counter()
    model.swap_ready()
    state.prefill()
    if on_step:
        on_step(state.result)
    times["prefill_s"] = time.perf_counter() - started
    transfer_before, draft_before = model.comm.seconds, state.drafts.seconds if state.drafts else 0.0
    while any(state.active):
        model.swap_ready()  # a step boundary: graphs compiled meanwhile run from this step on
        step_start = time.perf_counter()
        # serve's warm-up: steps 0-3 speculate and propose, speculate and fill, fill plainly, propose plainly
        state.step(not request.every_step_kind or times["steps"] % 4 in (0, 3))
        computed = time.perf_counter()
        state.commit(count_metrics=True)
        state.advance()
        if on_step:
            on_step(state.result)
        times["target_s"] += computed - step_start
        times["host_s"] += time.perf_counter() - computed
        times["steps"] += 1
    times["decode_s"] = time.perf_counter() - started - times["prefill_s"]
    times["transfer_s"] = model.comm.seconds - transfer_before
    times["draft_s"] = state.drafts.seconds - draft_before if state.drafts else 0.0
    times["target_s"] -= times["transfer_s"] + times["draft_s"]  # the step's compute, less what is accounted apart
    state.result.rank_times = gather_times(model.comm, times)
    return state.result


def gather_times(comm: PipelineComm, times: dict[str, float]) -> list[dict[str, float]]:
    """Every rank's phase times, on the first rank (which reports the result); [] on the others."""
    timings = torch.tensor([times[name] for name in STEP_PHASES], dtype=torch.float64, device=comm.device)
    gathered = comm.gather(timings, 0, "step timings")
    if gathered is None:
        return []
    return [dict(zip(STEP_PHASES, row, strict=True)) for row in gathered.tolist()]
