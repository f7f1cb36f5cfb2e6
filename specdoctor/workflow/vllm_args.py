"""specdoctor's flags as vLLM spells them, for `check` and `serve` with `--engine vllm`: the model, its
parallelism, dtype, compile mode, prefix caching and drafter; every flag specdoctor does not declare goes to vLLM
as the user wrote it. A runtime flag vLLM has no counterpart for is refused, never silently dropped."""

from __future__ import annotations

import dataclasses
import json

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.options import RuntimeOptions

# The RuntimeOptions fields that apply to a vLLM run, given to vLLM (vllm_arguments); `check` also encodes its
# battery with `tokenizer`, and hands vLLM token ids (so vLLM loads none there).
TRANSLATED = (
    "model",
    "speculative_model",
    "speculative_method",
    "num_speculative_tokens",
    "tokenizer",
    "tp",
    "pp",
    "dtype",
    "compile",
    "enable_prefix_caching",
)


def refuse_runtime_only(runtime: RuntimeOptions, defaults: RuntimeOptions) -> None:
    """A flag of specdoctor's own runtime (a loading policy, a fault, a rank timeout, ...) given with
    --engine vllm: one line naming it, as vLLM would never apply it."""
    for spec in dataclasses.fields(RuntimeOptions):
        if spec.name not in TRANSLATED and getattr(runtime, spec.name) != getattr(defaults, spec.name):
            raise SpecdoctorError(
                f"{spec.metadata['flags'][0]} is a flag of specdoctor's own runtime: vLLM has none like it "
                "(--engine vllm passes vLLM's own flags through as written)"
            )


def vllm_arguments(
    runtime: RuntimeOptions, checkpoint, drafter, k: int, passed: list[str], token_ids_only: bool
) -> list[str]:
    """vLLM's flags for this run: specdoctor's translated flags, then the user's own vLLM flags (`passed`)."""
    speculative = {"method": drafter.name, "num_speculative_tokens": k}
    if drafter.path:  # a drafter checkpoint of its own (an EAGLE-3 head, a draft model)
        speculative["model"] = str(drafter.path)
    arguments = [vllm_spelling("model"), str(checkpoint.path), vllm_spelling("tp"), str(runtime.tp)]
    arguments += [vllm_spelling("pp"), str(runtime.pp), vllm_spelling("dtype"), str(runtime.dtype)]
    if token_ids_only:
        arguments += ["--skip-tokenizer-init"]  # check's battery is token ids in, token ids out
    elif runtime.tokenizer:
        arguments += [vllm_spelling("tokenizer"), runtime.tokenizer]
    arguments += [] if runtime.compile else ["--enforce-eager"]
    arguments += ["--enable-prefix-caching" if runtime.enable_prefix_caching else "--no-enable-prefix-caching"]
    return [*arguments, "--speculative-config", json.dumps(speculative), *passed]


def vllm_spelling(name: str) -> str:
    """vLLM's flag for a RuntimeOptions field: the longest of the spellings the field declares (they include
    vLLM's: `--tensor-parallel-size` beside `--tp`)."""
    flags = next(spec for spec in dataclasses.fields(RuntimeOptions) if spec.name == name).metadata["flags"]
    return max((flag for flag in flags if flag.startswith("--")), key=len)


def without_speculation(arguments: list[str]) -> list[str]:
    """The same vLLM with speculation off: the reference for the lossless comparison."""
    at = arguments.index("--speculative-config")
    return arguments[:at] + arguments[at + 2 :]
