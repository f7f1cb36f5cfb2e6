"""A batch of prompts decoded across pipeline ranks, with or without MTP speculative decoding.

Every rank runs `decode_batch` in lockstep. Tokens are known to all ranks (the last rank broadcasts
each step's decision); only hidden states travel rank to rank. The last rank verifies drafts,
proposes the next ones and decides (runtime/speculative.py); every other rank learns from that
broadcast how many tokens were accepted, so positions and KV caches stay in sync on all of them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.comm import PipelineComm
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.drafter.loading import Provenance
from specdoctor.runtime.kv_cache import KVCache, new_cache
from specdoctor.runtime.logprobs import TokenLogprob, emitted_logprobs
from specdoctor.runtime.metrics import SpecMetrics
from specdoctor.runtime.models.stage import TargetStage
from specdoctor.runtime.options import MAX_SPECULATIVE_TOKENS, DraftSampleMethod
from specdoctor.runtime.partition import Placement
from specdoctor.runtime.rows import take_rows
from specdoctor.runtime.sampling import RowSampler, SamplingParams
from specdoctor.runtime.speculative import Drafts, commit, finish_device_work, speculative_step
from specdoctor.runtime.taps import TapRoute
from specdoctor.runtime.verify import PLACEHOLDER


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate: its prompt, its limit, how it samples, and the token ids that end it."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # report each token's log-probability and this many top alternatives


@dataclass(frozen=True)
class GenerateRequest:
    prompts: list[list[int]]
    max_new_tokens: int | list[int]  # one limit for the batch, or one per prompt
    sampling: SamplingParams = SamplingParams()
    num_speculative_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    stream: bool = False  # report the tokens so far after every step (costs a message per step)
    draft_sample_method: DraftSampleMethod = DraftSampleMethod.GREEDY  # when sampling: how drafts are picked

    def limits(self) -> list[int]:
        if isinstance(self.max_new_tokens, int):
            return [self.max_new_tokens] * len(self.prompts)
        return list(self.max_new_tokens)

    def sequences(self) -> list[SequenceRequest]:
        """One per prompt; a seeded batch gives row r the seed + r, so its rows draw different numbers."""
        sampling = self.sampling

        def seeded(row: int) -> SamplingParams:
            return sampling if sampling.seed is None else dataclasses.replace(sampling, seed=sampling.seed + row)

        return [
            SequenceRequest(prompt, limit, seeded(row), self.eos_token_ids)
            for row, (prompt, limit) in enumerate(zip(self.prompts, self.limits(), strict=True))
        ]


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    finish_reasons: list[str]
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    proposals: list[int] = field(default_factory=list)  # every draft token proposed, for constant-output checks
    row_metrics: list[SpecMetrics] = field(default_factory=list)  # the same counters, per prompt
    rank_times: list[dict[str, float]] = field(default_factory=list)  # per rank: where the time went (STEP_PHASES)
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # per row, for rows that asked (last rank)


# Where a rank's time goes: the prompt pass, then per decode step its share of the target forward
# (plus head and acceptance on the last rank), the drafter, inter-rank transfers (waiting for a
# peer included), and the host bookkeeping that appends tokens.
STEP_PHASES = ("prefill_s", "decode_s", "target_s", "draft_s", "transfer_s", "host_s", "steps")


@dataclass
class RankModel:
    placement: Placement
    stage: TargetStage
    drafter: object | None  # on the drafter's rank: an MtpDrafter or a DSparkDrafter
    comm: PipelineComm
    device: torch.device
    dtype: torch.dtype
    checkpoint: Checkpoint | None = None
    provenance: Provenance = field(default_factory=Provenance)  # drafter tensor -> where it came from
    state_rollback: bool = True  # False reproduces an engine that never rolls recurrent states back
    taps: TapRoute | None = None  # a block drafter's taps: this rank's part in moving them
    drafter_checkpoint: Checkpoint | None = None  # a drafter that is a checkpoint of its own

    @property
    def speculates(self) -> bool:
        """The pipeline has a drafter: the target's MTP layers, or a drafter checkpoint."""
        return bool(self.stage.config.num_nextn_predict_layers or self.drafter_checkpoint)

    def cache(self, batch: int, max_len: int, drafter: bool = False) -> KVCache:
        """A cache for this rank's layers, or for the drafter's."""
        if drafter:
            return self.drafter.new_cache(batch, max_len, self.dtype, self.device)
        config = self.stage.config
        return new_cache(
            config, self.stage.layer_ids, batch, max_len, self.dtype, self.device, False, self.state_rollback
        )


def pad_right(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, Lmax] padded with 0 (padding lands past each sequence's end, masked by position)
    and the prompt lengths [B]."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = torch.tensor(prompt, device=device)
    return ids, lengths


def pipeline_pass(model: RankModel, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, captured=None):
    """Run this rank's layers on a [B, T] step. The last rank gets (hidden states [B, T, H], a block drafter's
    taps [B, T, taps, H] or None); the others (None, None). Taps travel with the hidden states (runtime/taps.py).
    `captured`, when given, receives every entry this rank's stage captured (the tap probe)."""
    placement, stage, route = model.placement, model.stage, model.taps
    upstream: list[torch.Tensor] = []
    if placement.is_first:
        inputs = tokens
    else:
        received = route.received if route else 0
        width = (1 + received,) if received else ()
        inputs = model.comm.recv_prev((*tokens.shape, *width, stage.config.hidden_size), model.dtype)
        if received:
            inputs, *upstream = inputs.unbind(2)
    hidden, own = stage.forward_with_taps(inputs, positions, cache)
    if captured is not None:
        captured.update(own)
    if placement.is_last:
        return hidden, route.assemble(upstream, own, hidden) if route else None
    sent = [*upstream, *(own[entry] for entry in route.own)] if route and route.sent else []
    model.comm.send_next(torch.stack([hidden, *sent], dim=2) if sent else hidden)
    return None, None


@torch.no_grad()
def prompt_logits(model: RankModel, prompts: list[list[int]]) -> torch.Tensor | None:
    """Target logits at every prompt position, [B, Lmax, V] on the last rank (rows past a prompt's end are padding)."""
    ids, _ = pad_right(prompts, model.device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand(len(prompts), -1)
    hidden, _ = pipeline_pass(model, ids, positions, model.cache(len(prompts), ids.shape[1]))
    return None if hidden is None else model.stage.logits(hidden).float().cpu()


def check_request(request: GenerateRequest, cfg: ModelConfig, speculates: bool) -> None:
    if len(request.limits()) != len(request.prompts):
        raise SpecdoctorError("max_new_tokens must be at least 1, one limit per prompt")
    check_sequences(request.sequences(), request.num_speculative_tokens, cfg, speculates)


def check_sequences(sequences: list[SequenceRequest], k: int, cfg: ModelConfig, speculates: bool) -> None:
    if not sequences or any(len(s.prompt) == 0 for s in sequences):
        raise SpecdoctorError("every prompt needs at least one token")
    if min(s.max_new_tokens for s in sequences) < 1:
        raise SpecdoctorError("max_new_tokens must be at least 1, one limit per prompt")
    check_speculative_tokens(k, speculates)
    longest = max(len(s.prompt) + s.max_new_tokens for s in sequences)
    if longest > cfg.max_position_embeddings:
        raise SpecdoctorError(
            f"prompt + max_new_tokens = {longest} exceeds the context of {cfg.max_position_embeddings}"
        )


def check_speculative_tokens(k: int, speculates: bool) -> None:
    """`speculates`: the pipeline has a drafter (the target's MTP layers, or a drafter checkpoint)."""
    if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise SpecdoctorError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
    if k and not speculates:
        raise SpecdoctorError(
            "this model has no MTP layers (num_nextn_predict_layers = 0) and no drafter checkpoint was given "
            "(--speculative-model): no drafter to run"
        )


class BatchState:
    """One batch's decoding state on one rank: its caches, the last decision and how far each row got.
    Rows can join (`regroup` of a running batch and a prefilled one) and leave (`regroup` with rows)."""

    def __init__(self, model: RankModel, sequences: list[SequenceRequest], k: int, sampled_drafts: bool = False):
        self.model, self.sequences, self.k = model, sequences, k
        self.ids, self.lengths = pad_right([s.prompt for s in sequences], model.device)
        batch = len(sequences)
        # An active row has filled <= prompt + max_new - 2; a step writes up to k + (k - 1) positions past it.
        max_len = int(self.lengths.max()) + max(s.max_new_tokens for s in sequences) + 2 * k
        self.cache = model.cache(batch, max_len)
        self.sampler, self.drafts = None, None
        if model.placement.is_last:
            self.sampler = RowSampler([s.sampling for s in sequences], model.device)
            if k:
                mtp_cache = model.cache(batch, max_len, drafter=True)
                self.drafts = Drafts(model.drafter, mtp_cache, k, self.sampler, sampled_drafts, model.device)
        self.result = GenerateResult([[] for _ in range(batch)], [""] * batch)
        self.result.row_metrics = [SpecMetrics() for _ in range(batch)]
        self.result.logprobs = [[] for _ in range(batch)]
        self.pending_logprobs: dict[int, list[TokenLogprob]] = {}  # the last step's, until committed
        self.decision = torch.empty(batch, 2 * k + 2, dtype=torch.long, device=model.device)
        self.filled = self.lengths.clone()  # positions [0, filled) hold valid KV entries on every rank
        self.active = [True] * batch

    def commit(self, count_metrics: bool) -> None:
        before = [len(tokens) for tokens in self.result.tokens]
        self.active = commit(self.result, self.decision, self.k, self.sequences, count_metrics, self.active)
        for row, entries in self.pending_logprobs.items():  # the emitted tokens' entries, in order
            self.result.logprobs[row] += entries[: len(self.result.tokens[row]) - before[row]]
        self.pending_logprobs = {}

    def note_logprobs(self, logits: torch.Tensor) -> None:
        """On the last rank, before the commit: the log-probabilities of this step's emitted tokens."""
        wanted = {row: s.logprobs for row, s in enumerate(self.sequences) if s.logprobs is not None}
        if wanted:
            emitted = self.decision[:, 1 : 1 + logits.shape[1]]  # [B, T]: emitted token j came from position j
            self.pending_logprobs = emitted_logprobs(logits, emitted, wanted)

    def prefill(self) -> None:
        """The prompts through every rank; the last rank picks the first token and the first drafts."""
        model, batch = self.model, len(self.sequences)
        positions = torch.arange(self.ids.shape[1], device=model.device).expand(batch, -1)
        self.cache.begin(valid_end=self.lengths, keep_positions=False)
        hidden, taps = pipeline_pass(model, self.ids, positions, self.cache)
        self.cache.commit(self.lengths - 1, torch.ones(batch, dtype=torch.bool, device=model.device))
        if model.placement.is_last:
            rows, last = torch.arange(batch, device=model.device), self.lengths - 1
            final = model.stage.model.norm(hidden)  # [B, L, H]: an MTP drafter is fed the final-normed states
            logits = model.stage.lm_head(final[rows, last][:, None])  # [B, 1, V]: only the last position's
            first = speculative_step(logits, None, None, None, self.sampler)  # [B, 2]
            self.decision.fill_(PLACEHOLDER)
            self.decision[:, :2] = first
            self.note_logprobs(logits)
            if self.drafts:
                # The MTP input at each prompt position is the next token: the prompt's, then the first new one.
                next_tokens = torch.cat([self.ids[:, 1:], self.ids[:, :1]], dim=1).scatter(
                    1, last[:, None], first[:, 1:2]
                )
                self.drafts.propose(next_tokens, final if taps is None else taps, positions, base=last)
                self.decision[:, self.k + 2 :] = self.drafts.tokens
        model.comm.broadcast_from_last(self.decision)
        self.commit(count_metrics=False)

    def step(self) -> None:
        """Verify the pending token and the drafts in one pipeline pass; every rank commits the decision."""
        model, k, decision = self.model, self.k, self.decision
        pending_and_drafts = torch.cat([decision.gather(1, 1 + decision[:, :1]), decision[:, k + 2 :]], dim=1)
        positions = self.filled[:, None] + torch.arange(k + 1, device=model.device)  # [B, k+1]
        self.cache.begin(valid_end=None, keep_positions=True)  # the accepted count is known only after
        hidden, taps = pipeline_pass(model, pending_and_drafts, positions, self.cache)
        if model.placement.is_last:
            final, logits = model.stage.head(hidden)
            features = final if taps is None else taps  # what the drafter reads (Drafts.propose)
            self.decision = speculative_step(logits, features, positions, self.drafts, self.sampler)
            self.note_logprobs(logits)
        model.comm.broadcast_from_last(self.decision)
        finish_device_work(model.device)

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
        joined.decision = take_rows(torch.cat([b.decision for b in batches]), rows)
        joined.filled = take_rows(torch.cat([b.filled for b in batches]), rows)
        keep = range(len(sequences)) if rows is None else rows

        def kept(values: list) -> list:
            return [values[r] for r in keep]

        joined.active = kept([a for b in batches for a in b.active])
        joined.result = GenerateResult(
            kept([t for b in batches for t in b.result.tokens]),
            kept([f for b in batches for f in b.result.finish_reasons]),
        )
        joined.result.row_metrics = kept([m for b in batches for m in b.result.row_metrics])
        joined.result.logprobs = kept([entries for b in batches for entries in b.result.logprobs])
        joined.pending_logprobs = {}
        joined.ids = joined.lengths = None
        return joined


@torch.no_grad()
def decode_batch(model: RankModel, request: GenerateRequest, on_step=None) -> GenerateResult:
    """Run one batch of prompts to completion; every rank returns the same result.
    `on_step(result)` sees the result as it grows, after every step (for streaming)."""
    check_request(request, model.stage.config, model.speculates)
    sampled_drafts = request.draft_sample_method == DraftSampleMethod.PROBABILISTIC
    state = BatchState(model, request.sequences(), request.num_speculative_tokens, sampled_drafts)
    times = dict.fromkeys(STEP_PHASES, 0.0)
    started = time.perf_counter()
    state.prefill()
    if on_step:
        on_step(state.result)
    times["prefill_s"] = time.perf_counter() - started
    transfer_before, draft_before = model.comm.seconds, state.drafts.seconds if state.drafts else 0.0
    while any(state.active):
        step_start = time.perf_counter()
        state.step()
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
