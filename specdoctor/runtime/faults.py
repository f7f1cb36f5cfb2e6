"""Engine faults the runtime reproduces on demand (`--fault`), each as an engine shipped it, so that `probe`'s
sweeps and `check`'s per-TP-rank measurement are tested against the failure they exist to find (docs/probe.md
§Faults, docs/tensor-parallel.md).

  drafter-max-position=N   past N positions every row drafts dummy token 0, as vLLM does once the batch's
                           longest sequence plus k passes a draft's max_model_len (vllm#58080)
  drafter-rope-past=N      the drafter's positions from N on rotate as their remainder by N: a drafter run past
                           its trained range without the target's RoPE scaling (its acceptance falls, partly)
  stale-batch-rows         with more than one row, every row but the first feeds the drafter the input of the
                           batch's first decode step: a drafter buffer row not refreshed (tokenspeed#955)
  prefix-cache-drafter-kv  a prompt's blocks found in the prefix cache get the target's K/V back but not the
                           drafter's: it reads what the reused blocks held, another prompt's (vllm#47930)
  rejection-reuse-uniform  the recovered token draws no fresh noise: it reuses the draft's acceptance
                           uniform for every candidate, so the race is decided by the residual alone
                           (vllm-ascend#16370); output at temperature > 0 is no longer the target's
  sampling-params-ignored  verification computes the target's distribution at temperature 1, whatever temperature,
                           top-p or top-k the request asked (vLLM v0, vllm#9834, fixed by #10198): sampled output
                           at another setting is temperature-1 text, and its acceptance falls
  stop-in-draft-missed     a stop token id (the end-of-sequence one included) accepted inside a step's run is not
                           seen: only the run's last token is checked against them (sglang#23802's class)
  eos-leak-past-max-tokens the step whose run crosses max_tokens appends the whole run: tokens past the limit,
                           and past a stop token in it, leak into the output (sglang#33758)
  penalties-per-step       repetition, frequency and presence penalties at every verified position counted from the
                           output committed before the step, not from the drafts accepted before it (sglang#33643's
                           class): a token repeated inside an accepted run goes unpenalised, so the output is not
                           plain decoding's
  logprobs-of-draft        the log-probabilities reported for an accepted draft are the drafter's distribution at
                           that position, not the target's (vllm#34497's class)
  grammar-no-rollback      structured output's matcher walks a step's drafts to mask each verified position and is
                           not rolled back: the state after rejected drafts masks the tokens that follow (the
                           rollback xgrammar exists to do, vLLM's StructuredOutputManager)
  reasoning-end-unmasked   behind a reasoning parser, a step whose drafts end the reasoning leaves the positions
                           after that end without the grammar's bitmask: it starts at the next step (vllm#44006)
  per-rank-sharing         under TP, each rank of the drafter's stage decides alone whether to give the drafter
                           the target's embedding: TP rank 0 does, the others leave their shard as allocated
                           (vllm#50158)
  vocab-shard-shifted      under TP, the last TP rank reads its slice of the drafter's embedding at the range of
                           the rank before it (a shard range computed off by one shard)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specdoctor.errors import SpecdoctorError

SWITCHES = (
    "stale-batch-rows",
    "prefix-cache-drafter-kv",
    "rejection-reuse-uniform",
    "sampling-params-ignored",
    "stop-in-draft-missed",
    "eos-leak-past-max-tokens",
    "penalties-per-step",
    "logprobs-of-draft",
    "grammar-no-rollback",
    "reasoning-end-unmasked",
    "per-rank-sharing",
    "vocab-shard-shifted",
)  # the faults without a value
VALUED = ("drafter-max-position", "drafter-rope-past")  # the faults with a position: NAME=N
FAULT_NAMES = (*(f"{name}=N" for name in VALUED), *SWITCHES)


@dataclass(frozen=True)
class Faults:
    drafter_max_position: int | None = None
    drafter_rope_past: int | None = None
    stale_batch_rows: bool = False
    prefix_cache_drafter_kv: bool = False
    rejection_reuse_uniform: bool = False
    sampling_params_ignored: bool = False
    stop_in_draft_missed: bool = False
    eos_leak_past_max_tokens: bool = False
    penalties_per_step: bool = False
    logprobs_of_draft: bool = False
    grammar_no_rollback: bool = False
    reasoning_end_unmasked: bool = False
    per_rank_sharing: bool = False
    vocab_shard_shifted: bool = False

    @staticmethod
    def parse(text: str | None) -> "Faults":
        """`--fault`'s value: fault names, comma-separated."""
        fields: dict = {}
        for item in (text or "").split(","):
            name, _, value = item.strip().partition("=")
            if not name:
                continue
            if name in VALUED and value.isdigit() and int(value) > 0:
                fields[name.replace("-", "_")] = int(value)
            elif name in SWITCHES and not value:
                fields[name.replace("-", "_")] = True
            else:
                raise SpecdoctorError(f"--fault: unknown fault {item.strip()!r} (choose from {', '.join(FAULT_NAMES)})")
        return Faults(**fields)

    def gated(self, limit: int | None) -> "Faults":
        """These faults, with dummy drafts past `limit` too (a draft model's range under vLLM's gate)."""
        if limit is None:
            return self
        current = self.drafter_max_position
        return replace(self, drafter_max_position=limit if current is None else min(current, limit))
