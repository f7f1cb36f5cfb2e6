"""What a caller asks the pipeline to generate, what it gets back, and the validation every request
passes before any rank sees it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.config import ModelConfig
from specdoctor.runtime.decode.adjustments import LogitAdjustments
from specdoctor.runtime.decode.grammar import GrammarRequest
from specdoctor.runtime.decode.logprobs import PromptLogprob, TokenLogprob
from specdoctor.runtime.decode.metrics import SpecMetrics
from specdoctor.runtime.options import MAX_SPECULATIVE_TOKENS, DraftSampleMethod
from specdoctor.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence to generate: its prompt, its limit, how it samples, and the token ids that end it."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # report each token's log-probability and this many top alternatives
    adjustments: LogitAdjustments = LogitAdjustments()  # penalties, logit_bias, min_tokens
    grammar: GrammarRequest | None = None  # structured output: what the output must match
    prompt_logprobs: int | None = None  # each prompt token's log-probability and this many top alternatives


@dataclass(frozen=True)
class GenerateRequest:
    prompts: list[list[int]]
    max_new_tokens: int | list[int]  # one limit for the batch, or one per prompt
    sampling: SamplingParams = SamplingParams()
    num_speculative_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()
    stream: bool = False  # report the tokens so far after every step (costs a message per step)
    draft_sample_method: DraftSampleMethod = DraftSampleMethod.GREEDY  # when sampling: how drafts are picked
    # serve's warm-up with adaptive speculation: the steps cycle through every kind a served batch runs (speculative or
    # plain, each proposing drafts or only filling the drafter's cache), so each meets its graphs before any request
    every_step_kind: bool = False
    grammar: GrammarRequest | None = None  # structured output, for every prompt

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
            SequenceRequest(prompt, limit, seeded(row), self.eos_token_ids, grammar=self.grammar)
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
    cached_tokens: list[int] = field(default_factory=list)  # per row: prompt tokens restored by prefix caching
    prompt_logprobs: list[list[PromptLogprob] | None] = field(default_factory=list)  # per row that asked (last rank)
    # per row: the stop token id that ended it, left out of `tokens` (vLLM reports it as the last token id, counts
    # it in usage and gives it a log-probability; its text is not the output's)
    stop_tokens: list[int | None] = field(default_factory=list)

    def __post_init__(self):
        self.stop_tokens = self.stop_tokens or [None] * len(self.tokens)


# Where a rank's time goes: the prompt pass, then per decode step its share of the target forward
# (plus head and acceptance on the last rank), the drafter, inter-rank transfers (waiting for a
# peer included), and the host bookkeeping that appends tokens.
STEP_PHASES = ("prefill_s", "decode_s", "target_s", "draft_s", "transfer_s", "host_s", "steps")


def validate_request(request: GenerateRequest, cfg: ModelConfig, speculates: bool) -> None:
    if len(request.limits()) != len(request.prompts):
        raise SpecdoctorError("max_new_tokens must be at least 1, one limit per prompt")
    validate_sequences(request.sequences(), request.num_speculative_tokens, cfg, speculates)


def validate_sequences(sequences: list[SequenceRequest], k: int, cfg: ModelConfig, speculates: bool) -> None:
    if not sequences or any(len(s.prompt) == 0 for s in sequences):
        raise SpecdoctorError("every prompt needs at least one token")
    if min(s.max_new_tokens for s in sequences) < 1:
        raise SpecdoctorError("max_new_tokens must be at least 1, one limit per prompt")
    validate_speculative_tokens(k, speculates)
    for s in sequences:
        validate_adjustments(s, cfg.vocab_size)
    longest = max(len(s.prompt) + s.max_new_tokens for s in sequences)
    if longest > cfg.max_position_embeddings:
        raise SpecdoctorError(
            f"prompt + max_new_tokens = {longest} exceeds the context of {cfg.max_position_embeddings}"
        )


def validate_adjustments(sequence: SequenceRequest, vocab: int) -> None:
    """vLLM's bounds (its SamplingParams' validation)."""
    wanted = sequence.adjustments
    if not 0 <= wanted.min_tokens <= sequence.max_new_tokens:
        limit = sequence.max_new_tokens
        raise SpecdoctorError(f"min_tokens must be in 0..max_tokens ({limit}), got {wanted.min_tokens}")
    if not wanted.repetition_penalty > 0 or wanted.repetition_penalty == float("inf"):
        raise SpecdoctorError(f"repetition_penalty must be a finite number > 0, got {wanted.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2 <= getattr(wanted, name) <= 2:
            raise SpecdoctorError(f"{name} must be in [-2, 2], got {getattr(wanted, name)}")
    for name, ids in (("logit_bias", [token for token, _ in wanted.logit_bias]), ("stop", sequence.stop_token_ids)):
        outside = [token for token in ids if not 0 <= token < vocab]
        if outside:
            raise SpecdoctorError(f"{name} names token ids outside the vocabulary of {vocab}: {outside[:5]}")


def validate_speculative_tokens(k: int, speculates: bool) -> None:
    """`speculates`: the pipeline has a drafter (the target's MTP layers, or a drafter checkpoint)."""
    if not 0 <= k <= MAX_SPECULATIVE_TOKENS:
        raise SpecdoctorError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, got {k}")
    if k and not speculates:
        raise SpecdoctorError(
            "this model has no MTP layers (num_nextn_predict_layers = 0) and no drafter checkpoint was given "
            "(--speculative-model): no drafter to run"
        )
