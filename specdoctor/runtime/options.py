"""The options that configure a pipeline runtime, declared once.

Each field carries its flag spellings (the short ones and vLLM's, so a user can paste the flags
of the vLLM command they deploy with) and its help text; `commands/options.py` turns the fields
into typer options. The same object travels unchanged from the flags to the Engine and to every
rank process. This module stays free of torch so that the CLI starts quickly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.faults import Faults

FEWEST_PLAIN_ROWS = 8  # below, every step speculates: latency is what speculation is for, and one row's steps
# are too short to time apart from the noise (on the demo a 1-stream load ran 16 % slower when they were)


class Choice(str, Enum):
    """A closed set of string values: typer lists them as choices; formats as the bare value."""

    def __str__(self) -> str:
        return self.value


class EmbeddingPolicy(Choice):
    """How the drafter's embedding is loaded (runtime/drafter/policy.py says which engines do each)."""

    FIXED = "fixed"
    ENGINE_LEGACY = "engine-legacy"
    ALIAS_PLACEHOLDER = "alias-placeholder"


class HeadPolicy(Choice):
    """How the drafter's head (`shared_head.head`) is loaded."""

    FIXED = "fixed"
    ENGINE_LEGACY = "engine-legacy"
    UNLOADED = "unloaded"
    # The target's lm_head in place of the drafter's own, even where it ships one: for a reduced draft
    # vocabulary, logits over the whole vocabulary that d2t never maps (vllm-ascend#11374).
    TARGET = "target"


class D2tPolicy(Choice):
    """How an EAGLE-3 head's draft-to-target id map (`d2t`, for a reduced draft vocabulary) is loaded."""

    FIXED = "fixed"
    IGNORED = "ignored"  # left at vLLM's zeros: draft id i is taken as target id i


class DraftRangePolicy(Choice):
    """What a draft model drafts once a sequence passes its position range (docs/draft-model.md)."""

    FIXED = "fixed"  # it drafts on: the runtime computes its rotary embedding at any position
    # vLLM's length gate: once the batch's longest sequence plus k passes the draft's max_model_len, dummy token 0
    # for every row of the batch (vllm#58080)
    DUMMY = "dummy"


class Fill(Choice):
    """What a drafter tensor that no loader filled holds."""

    EMPTY = "empty"  # whatever torch.empty gave: varies from run to run
    ZEROS = "zeros"
    NAN = "nan"
    STALE = "stale"  # another weight's bytes, as a caching allocator's reused block


class TapPolicy(Choice):
    """How a block drafter's taps (target layers' hidden states) reach the drafter's rank (runtime/drafter/taps.py)."""

    FIXED = "fixed"  # each rank sends its taps on with the hidden states (vLLM 0.32)
    LOCAL_ONLY = "local-only"  # not relayed: the drafter's rank reads zeros for layers it does not own
    # The ids misread by one layer: DSpark's taken without vLLM's + 1 (a layer's input, not its output);
    # EAGLE-3's, entries already, given the + 1 again (sglang#25454: one layer late).
    OFF_BY_ONE = "off-by-one"
    ENGINE_DEFAULT = "engine-default"  # the config's ids ignored: vLLM's default (2, L // 2, L - 3) (vllm#50170)


class QuantizedWeights(Choice):
    """How quantised weights are held (docs/quantization.md §Memory)."""

    PACKED = "packed"  # as stored, through the quantised GEMMs: the memory engines use
    DEQUANTIZED = "dequantized"  # dequantised once at load, into the compute dtype (for comparison)


class MarkovPolicy(Choice):
    """How a DSpark drafter's Markov head (`markov_head.markov_w1`, `markov_w2`) is loaded."""

    FIXED = "fixed"
    UNLOADED = "unloaded"  # left as allocated (the fill), as a loader that drops the head's keys leaves it


class StateRollback(Choice):
    """What a hybrid model's recurrent state keeps after a step that rejected drafts."""

    EXACT = "exact"  # the state after the last accepted token
    BROKEN = "broken"  # the state after every verified token, rejected ones included (an engine without rollback)


class DraftSampleMethod(Choice):
    """How drafts are picked when the request samples (vLLM's `draft_sample_method`)."""

    GREEDY = "greedy"  # vLLM's default: the drafter's argmax, verified as a one-hot q
    PROBABILISTIC = "probabilistic"  # sampled from q, verified against q


class Device(Choice):
    CPU = "cpu"  # gloo between ranks
    CUDA = "cuda"  # NCCL between ranks


class Dtype(Choice):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"

    def torch(self):
        import torch

        return getattr(torch, self.value)


MAX_SPECULATIVE_TOKENS = 8


def option(default, *flags: str, help: str, required: bool = False):
    """A field with its command-line spellings and help (read by commands/options.py)."""
    return field(default=default, metadata={"flags": flags, "help": help, "required": required})


@dataclass(frozen=True)
class RuntimeOptions:
    model: str = option(
        None,
        "--model",
        help="Checkpoint directory, a Hugging Face id in the local cache, or a demo model's name (e.g. 'demo').",
        required=True,
    )
    speculative_model: str | None = option(
        None,
        "--speculative-model",
        help="A drafter checkpoint of its own (DSpark, EAGLE-3, a draft model); the DSpark and EAGLE-3 demos bring one",
    )
    # Each kind owns its method names: runtime/drafter/registry.py checks this one and reads it as its kind's.
    speculative_method: str | None = option(
        None,
        "--speculative-method",
        help="The drafter's method as vLLM names it (mtp, dspark, eagle3, draft_model; --speculative-config's "
        '"method"): checked against the checkpoint (default: read from it).',
    )
    tokenizer: str | None = option(
        None, "--tokenizer", help="A tokenizer.json, or a directory holding one (default: the checkpoint's own)."
    )
    pp: int = option(1, "--pp", "--pipeline-parallel-size", "-pp", help="Pipeline stages (--tp processes each).")
    pp_partition: str | None = option(
        None, "--pp-partition", help="Layers per rank, e.g. 14,12,12,7 (default: $VLLM_PP_LAYER_PARTITION, else even)."
    )
    tp: int = option(
        1,
        "--tp",
        "--tensor-parallel-size",
        "-tp",
        help="Tensor-parallel ranks per pipeline stage (TP x PP processes, sharded as vLLM shards them).",
    )
    num_speculative_tokens: int | None = option(
        0,
        "--num-speculative-tokens",
        help=f"Draft tokens per step (0 = plain decoding, at most {MAX_SPECULATIVE_TOKENS}; "
        "check: a DSpark drafter's block size, else 3).",
    )
    draft_sample_method: DraftSampleMethod = option(
        DraftSampleMethod.GREEDY,
        "--draft-sample-method",
        help="When sampling: greedy drafts verified as one-hot (vLLM's default) or drafts sampled from q.",
    )
    drafter_policy: EmbeddingPolicy = option(
        EmbeddingPolicy.FIXED, "--drafter-policy", help="How the drafter's embedding is loaded."
    )
    head_policy: HeadPolicy = option(HeadPolicy.FIXED, "--head-policy", help="How the drafter's head is loaded.")
    fill: Fill = option(Fill.EMPTY, "--fill", help="What unloaded drafter memory holds.")
    tap_policy: TapPolicy = option(
        TapPolicy.FIXED,
        "--tap-policy",
        help="DSpark and EAGLE-3: which target hidden states are tapped, and how they reach the drafter.",
    )
    d2t_policy: D2tPolicy = option(
        D2tPolicy.FIXED, "--d2t-policy", help="EAGLE-3 with a reduced draft vocabulary: its d2t map's loading."
    )
    draft_range_policy: DraftRangePolicy = option(
        DraftRangePolicy.FIXED,
        "--draft-range-policy",
        help="Draft models: past the draft's position range, draft on (fixed) or draft token 0 as vLLM does (dummy).",
    )
    markov_policy: MarkovPolicy = option(
        MarkovPolicy.FIXED, "--markov-policy", help="DSpark: its Markov head's loading."
    )
    state_rollback: StateRollback = option(
        StateRollback.EXACT,
        "--state-rollback",
        help="Hybrid models: roll the linear-attention state back to the last accepted token (exact), or not (broken).",
    )
    enable_prefix_caching: bool = option(
        False,
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Keep prompts' K/V in blocks for later prompts that start alike (serve: on, as in vLLM; not for "
        "hybrid models).",
    )
    adaptive_speculation: bool = option(
        False,
        "--adaptive-speculation/--always-speculate",
        help=f"serve: from {FEWEST_PLAIN_ROWS} rows, decode plainly where plain steps have yielded more tokens a "
        "second than speculative ones while serving, the drafter's cache kept whole (serve: on); else every step "
        "speculates.",
    )
    fault: str | None = option(
        None,
        "--fault",
        help="Reproduce engine faults, comma-separated: drafter-max-position=N, drafter-rope-past=N, stale-batch-rows, "
        "prefix-cache-drafter-kv, rejection-reuse-uniform, sampling-params-ignored, stop-in-draft-missed, "
        "eos-leak-past-max-tokens (docs/probe.md); "
        "per-rank-sharing, vocab-shard-shifted (docs/tensor-parallel.md).",
    )
    device: Device = option(Device.CPU, "--device", help="cpu (gloo) or cuda (NCCL).")
    dtype: Dtype = option(Dtype.FLOAT32, "--dtype", help="Compute dtype.")
    quantized_weights: QuantizedWeights = option(
        QuantizedWeights.PACKED,
        "--quantized-weights",
        help="Quantised checkpoints: keep weights packed and run the quantised GEMMs, or dequantise them at load.",
    )
    compile: bool = option(
        False,
        "--compile/--no-compile",
        " /--enforce-eager",
        help="Compile each rank's decode step with torch.compile (fused kernels; the graphs are kept in the compile "
        "cache, so only the first start with a model compiles for long). --enforce-eager is vLLM's --no-compile.",
    )
    timeout: float = option(60.0, "--timeout", help="Seconds a rank waits on a peer before failing.")

    def __post_init__(self):
        if not self.model:
            raise SpecdoctorError("--model is required")
        for spec in fields(self):  # the Python API may pass plain strings for the choices
            if isinstance(spec.default, Choice):
                kind = type(spec.default)
                value = getattr(self, spec.name)
                if value not in {choice.value for choice in kind}:
                    allowed = ", ".join(choice.value for choice in kind)
                    raise SpecdoctorError(
                        f"{spec.metadata['flags'][0]}: unknown value {value!r} (choose from {allowed})"
                    )
                object.__setattr__(self, spec.name, kind(value))
        if self.pp < 1:
            raise SpecdoctorError(f"--pp must be at least 1, got {self.pp}")
        if self.tp < 1:
            raise SpecdoctorError(f"--tensor-parallel-size must be at least 1, got {self.tp}")
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise SpecdoctorError(
                f"--num-speculative-tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        Faults.parse(self.fault)  # a bad --fault fails before anything starts
        if self.timeout <= 0:
            raise SpecdoctorError(f"--timeout must be positive, got {self.timeout}")
