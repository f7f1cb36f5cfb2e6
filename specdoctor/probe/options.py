"""What `probe` is asked to do: the battery's settings, and which sweeps to run with which settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdoctor.checks.acceptance import DEFAULT_MIN_ACCEPTANCE_LENGTH
from specdoctor.probe.sampling_settings import DEFAULT_SETTINGS, SamplingSetting, parse_settings

ALPHA = 0.001  # each sweep's family-wise false-positive rate, unless --alpha
DEFAULT_CONCURRENCY = (1, 4, 16)
DEFAULT_SAMPLING_TOKENS = 2000


@dataclass(frozen=True)
class SweepOptions:
    context: bool = False
    context_lengths: tuple[int, ...] = ()  # () : doubling from 128 up to the served max_model_len
    max_context: int | None = None  # where the server does not say its max_model_len
    sweep_prompts: int | None = None  # prompts per context bucket (None: sized for power) and prefix-cache group
    prefix_cache: bool = False
    concurrency: tuple[int, ...] = ()  # () : no concurrency sweep
    sampling_tokens: int = 0  # 0 : no sampling sweep; else the tokens sampled at each setting
    sampling_settings: tuple[SamplingSetting, ...] = parse_settings(DEFAULT_SETTINGS)
    reference_url: str | None = None  # the same model served with speculation off
    api: bool = False  # the request API under speculation (probe/api_sweep.py)
    every_sweep: bool = False  # --all: a sweep it cannot run for want of a flag is said, not left out silently
    alpha: float = ALPHA
    prompt_seed: int = 0  # where the sweeps' prompts start in the corpus (corpus.corpus_prompt)

    @property
    def asked(self) -> list[str]:
        """The sweeps asked for, in the order they run."""
        flags = {
            "context": self.context,
            "prefix-cache": self.prefix_cache,
            "concurrency": bool(self.concurrency),
            "sampling": bool(self.sampling_tokens),
            "reference": bool(self.reference_url),
            "api": self.api,
        }
        return [name for name, on in flags.items() if on]


@dataclass(frozen=True)
class ProbeOptions:
    url: str
    api_key: str | None = None
    model: str | None = None
    battery: Path | None = None
    min_acceptance_length: float = DEFAULT_MIN_ACCEPTANCE_LENGTH
    max_tokens: int = 32
    request_timeout: float = 60.0
    timeout: float = 600.0
    sweeps: SweepOptions = field(default_factory=SweepOptions)
