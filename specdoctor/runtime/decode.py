"""Generation across pipeline ranks, with or without MTP speculative decoding.

Every rank runs `generate` in lockstep. Tokens are known to all ranks (the last rank broadcasts
each step's decision); only hidden states travel rank to rank. The last rank verifies drafts,
proposes the next ones and decides; every other rank learns from that broadcast how many tokens
were accepted, so positions and KV caches stay in sync on all of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.checkpoint import Checkpoint
from specdoctor.runtime.comm import PipelineComm
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.generate import new_cache, pad_right
from specdoctor.runtime.kv_cache import KVCache
from specdoctor.runtime.metrics import SpecMetrics
from specdoctor.runtime.model import TargetStage
from specdoctor.runtime.mtp import MtpDrafter
from specdoctor.runtime.partition import Placement
from specdoctor.runtime.sampling import SamplingParams, probabilities, sample
from specdoctor.runtime.verify import PLACEHOLDER, verify_greedy, verify_random


@dataclass(frozen=True)
class GenerateRequest:
    prompts: list[list[int]]
    max_new_tokens: int | list[int]  # one limit for the batch, or one per prompt
    sampling: SamplingParams = SamplingParams()
    num_speculative_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    stream: bool = False  # report the tokens so far after every step (costs a message per step)

    def limits(self) -> list[int]:
        if isinstance(self.max_new_tokens, int):
            return [self.max_new_tokens] * len(self.prompts)
        return list(self.max_new_tokens)


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    finish_reasons: list[str]
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    proposals: list[int] = field(default_factory=list)  # every draft token proposed, for constant-output checks
    row_metrics: list[SpecMetrics] = field(default_factory=list)  # the same counters, per prompt
    rank_times: list[dict[str, float]] = field(default_factory=list)  # per rank: where the time went (STEP_PHASES)


# Where a rank's time goes: the prompt pass, then per decode step its share of the target forward
# (plus head and acceptance on the last rank), the drafter, inter-rank transfers (waiting for a
# peer included), and the host bookkeeping that appends tokens.
STEP_PHASES = ("prefill_s", "decode_s", "target_s", "draft_s", "transfer_s", "host_s", "steps")


@dataclass
class RankModel:
    placement: Placement
    stage: TargetStage
    drafter: MtpDrafter | None
    comm: PipelineComm
    checkpoint: Checkpoint | None = None
    provenance: dict[str, str] = field(default_factory=dict)  # drafter tensor -> where it came from


class Drafts:
    """The last rank's proposals: tokens [B, k] and, when sampling, their distributions q [B, k, V]."""

    def __init__(self, model: RankModel, batch: int, max_len: int, k: int, sampling: SamplingParams, generator):
        self.drafter, self.k, self.sampling, self.generator = model.drafter, k, sampling, generator
        self.cache = new_cache(model.stage, batch, max_len, model.stage.config.mtp_layer_ids)
        self.tokens = torch.zeros(batch, 0, dtype=torch.long, device=next(model.stage.parameters()).device)
        self.probs: torch.Tensor | None = None
        self.seconds = 0.0  # time spent proposing, for the step profile

    def propose(
        self,
        next_tokens: torch.Tensor,  # [B, T] the token after each position
        hidden: torch.Tensor,  # [B, T, H] target hidden states (last layer, before the final norm)
        positions: torch.Tensor,  # [B, T]
        base: torch.Tensor,  # [B] index of the last accepted position: the chain starts there
    ) -> None:
        """Run MTP step 0 over every new position (filling its KV cache), then chain k-1 more steps."""
        start = time.perf_counter()
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        out, logits = self.drafter(next_tokens, hidden, positions, step=0, cache=self.cache)
        out, logits, position = out[rows, base][:, None], logits[rows, base], positions[rows, base][:, None]
        tokens, probs = [], []
        for step in range(self.k):
            token, q = self._pick(logits)
            tokens.append(token)
            probs.append(q)
            if step + 1 < self.k:
                position = position + 1
                out, step_logits = self.drafter(token[:, None], out, position, step=step + 1, cache=self.cache)
                logits = step_logits[:, 0]
        self.tokens = torch.stack(tokens, dim=1)
        self.probs = None if self.sampling.greedy else torch.stack(probs, dim=1)
        _finish_device_work(self.tokens.device)
        self.seconds += time.perf_counter() - start

    def _pick(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # logits: [B, V]
        if self.sampling.greedy:
            return logits.argmax(-1), None
        q = probabilities(logits, self.sampling)
        return sample(q, self.generator), q


def pipeline_pass(model: RankModel, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache):
    """Run this rank's layers on a [B, T] step; the last rank gets hidden states [B, T, H], others None."""
    placement, stage = model.placement, model.stage
    if placement.is_first:
        inputs = tokens
    else:
        dtype = next(stage.parameters()).dtype
        inputs = model.comm.recv_prev((*tokens.shape, stage.config.hidden_size), dtype)
    hidden = stage(inputs, positions, cache)
    if placement.is_last:
        return hidden
    model.comm.send_next(hidden)
    return None


def speculative_step(
    model: RankModel,
    drafts: Drafts | None,
    hidden: torch.Tensor,  # [B, k+1, H] target hidden states at the pending token and each draft
    positions: torch.Tensor,  # [B, k+1]
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The last rank's step: verify the drafts against the target (p) and propose the next ones.

    Returns the decision every rank needs, [B, 2k+2]: accepted count n, the emitted tokens (the n
    accepted drafts then one recovered or bonus token, padded), and the next k drafts."""
    logits = model.stage.logits(hidden)  # [B, k+1, V]
    draft_tokens = drafts.tokens if drafts else logits.new_zeros(logits.shape[0], 0, dtype=torch.long)
    if sampling.greedy:
        accepted, emitted = verify_greedy(draft_tokens, logits)
    else:
        p = probabilities(logits, sampling)
        q = drafts.probs if drafts else p[:, :0]
        uniform = torch.rand(draft_tokens.shape, generator=generator, device=logits.device)
        accepted, emitted = verify_random(draft_tokens, q, p, uniform, generator)
    if drafts:
        # MTP input at position L+j is token L+j+1: accepted drafts, then the new token at index n.
        last_token = emitted.gather(1, accepted[:, None])
        next_tokens = torch.cat([draft_tokens, last_token], dim=1).scatter(1, accepted[:, None], last_token)
        drafts.propose(next_tokens, hidden, positions, base=accepted)
    new_drafts = drafts.tokens if drafts else draft_tokens
    return torch.cat([accepted[:, None], emitted, new_drafts], dim=1)


def _finish_device_work(device: torch.device) -> None:
    """CUDA runs ahead of the host: wait for it, so each phase's time is its own."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def prompt_logits(model: RankModel, prompts: list[list[int]]) -> torch.Tensor | None:
    """Target logits at every prompt position, [B, Lmax, V] on the last rank (rows past a prompt's end are padding)."""
    ids, _ = pad_right(prompts, next(model.stage.parameters()).device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand(len(prompts), -1)
    hidden = pipeline_pass(model, ids, positions, new_cache(model.stage, len(prompts), ids.shape[1]))
    return None if hidden is None else model.stage.logits(hidden).float().cpu()


def check_request(request: GenerateRequest, cfg: ModelConfig) -> None:
    if not request.prompts or any(len(p) == 0 for p in request.prompts):
        raise SpecdoctorError("every prompt needs at least one token")
    if len(request.limits()) != len(request.prompts) or min(request.limits()) < 1:
        raise SpecdoctorError("max_new_tokens must be at least 1, one limit per prompt")
    if not 0 <= request.num_speculative_tokens <= 8:
        raise SpecdoctorError(f"num_speculative_tokens must be in 0..8, got {request.num_speculative_tokens}")
    if request.num_speculative_tokens and cfg.num_nextn_predict_layers == 0:
        raise SpecdoctorError("this model has no MTP layers (num_nextn_predict_layers = 0): no drafter to run")
    longest = max(len(p) + limit for p, limit in zip(request.prompts, request.limits(), strict=True))
    if longest > cfg.max_position_embeddings:
        raise SpecdoctorError(
            f"prompt + max_new_tokens = {longest} exceeds the context of {cfg.max_position_embeddings}"
        )


@torch.no_grad()
def generate(model: RankModel, request: GenerateRequest, on_step=None) -> GenerateResult:
    """Run one batch of prompts to completion; every rank returns the same result.
    `on_step(result)` sees the result as it grows, after every step (for streaming)."""
    check_request(request, model.stage.config)
    k, sampling = request.num_speculative_tokens, request.sampling
    device = next(model.stage.parameters()).device
    ids, lengths = pad_right(request.prompts, device)
    batch = len(request.prompts)
    # An active row has filled <= prompt + max_new - 2; a step writes up to k + (k - 1) positions past it.
    max_len = int(lengths.max()) + max(request.limits()) + 2 * k
    cache = new_cache(model.stage, batch, max_len)
    generator = None
    drafts = None
    if model.placement.is_last:
        generator = torch.Generator(device=device)
        generator.manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
        if k:
            drafts = Drafts(model, batch, max_len, k, sampling, generator)
    result = GenerateResult([[] for _ in range(batch)], [""] * batch, row_metrics=[SpecMetrics() for _ in range(batch)])
    decision = torch.empty(batch, 2 * k + 2, dtype=torch.long, device=device)
    times = dict.fromkeys(STEP_PHASES, 0.0)
    started = time.perf_counter()

    # Prefill: the prompt through every rank; the last rank picks the first token and the first drafts.
    positions = torch.arange(ids.shape[1], device=device).expand(batch, -1)
    hidden = pipeline_pass(model, ids, positions, cache)
    if model.placement.is_last:
        rows = torch.arange(batch, device=device)
        last = lengths - 1
        first = speculative_step(
            model, None, hidden[rows, last][:, None], positions[rows, last][:, None], sampling, generator
        )
        if drafts:
            next_tokens = torch.cat([ids[:, 1:], ids[:, :1]], dim=1).scatter(1, last[:, None], first[:, 1:2])
            drafts.propose(next_tokens, hidden, positions, base=last)
        decision.fill_(PLACEHOLDER)
        decision[:, :2] = first
        if drafts:
            decision[:, k + 2 :] = drafts.tokens
    model.comm.broadcast_from_last(decision)
    filled = lengths.clone()  # positions [0, filled) hold valid KV entries on every rank
    active = _commit(result, decision, k, request, count_metrics=False)
    if on_step:
        on_step(result)
    times["prefill_s"] = time.perf_counter() - started
    transfer_before, draft_before = model.comm.seconds, drafts.seconds if drafts else 0.0

    while any(active):
        step_start = time.perf_counter()
        pending_and_drafts = torch.cat([decision.gather(1, 1 + decision[:, :1]), decision[:, k + 2 :]], dim=1)
        positions = filled[:, None] + torch.arange(k + 1, device=device)
        hidden = pipeline_pass(model, pending_and_drafts, positions, cache)
        if model.placement.is_last:
            decision = speculative_step(model, drafts, hidden, positions, sampling, generator)
        model.comm.broadcast_from_last(decision)
        _finish_device_work(device)
        computed = time.perf_counter()
        active = _commit(result, decision, k, request, count_metrics=True, active=active)
        # Finished rows stay in the batch but stop advancing, so they never outgrow the KV cache.
        filled = torch.where(torch.tensor(active, device=device), filled + decision[:, 0] + 1, filled)
        if on_step:
            on_step(result)
        times["target_s"] += computed - step_start
        times["host_s"] += time.perf_counter() - computed
        times["steps"] += 1
    times["decode_s"] = time.perf_counter() - started - times["prefill_s"]
    times["transfer_s"] = model.comm.seconds - transfer_before
    times["draft_s"] = drafts.seconds - draft_before if drafts else 0.0
    times["target_s"] -= times["transfer_s"] + times["draft_s"]  # the step's compute, less what is accounted apart
    result.rank_times = _gather_times(model.comm, times)
    return result


def _gather_times(comm: PipelineComm, times: dict[str, float]) -> list[dict[str, float]]:
    """Every rank's phase times, on the first rank (which reports the result); [] on the others."""
    gathered = comm.gather_to_first(
        torch.tensor([times[name] for name in STEP_PHASES], dtype=torch.float64, device=comm.device)
    )
    if gathered is None:
        return []
    return [dict(zip(STEP_PHASES, row, strict=True)) for row in gathered.tolist()]


def _commit(result, decision, k, request, count_metrics, active=None) -> list[bool]:
    """Append each active sequence's emitted tokens; stop at EOS or max_new_tokens.
    decision rows: [accepted n, emitted tokens (k+1, padded), next drafts (k)]."""
    active = active or [True] * len(result.tokens)
    limits = request.limits()
    still = []
    for row, (n, *rest) in enumerate(decision.tolist()):
        if not active[row]:
            still.append(False)
            continue
        if count_metrics and k:
            result.metrics.record(n, k)
            result.row_metrics[row].record(n, k)
        for token in rest[: n + 1]:
            if token in request.eos_token_ids:
                result.finish_reasons[row] = "stop"
                break
            result.tokens[row].append(token)
            if len(result.tokens[row]) >= limits[row]:
                result.finish_reasons[row] = "length"
                break
        still.append(not result.finish_reasons[row])
        if still[-1]:
            result.proposals += rest[k + 1 :]  # the drafts this sequence's next step will verify
    return still
