"""Every shared command-line option, declared once.

The runtime's options are the fields of `RuntimeOptions` (runtime/options.py): `runtime_command`
adds them to a command's typer signature, with each command's own defaults, and hands the command
one `RuntimeOptions`. The options shared by the report-producing commands are declared below.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from specdoctor.errors import SpecdoctorError
from specdoctor.runtime.options import RuntimeOptions

RUNTIME_PANEL = "Runtime (vLLM's spellings accepted)"
SPECULATIVE_CONFIG = "speculative_config"

BatteryOption = Annotated[
    Path | None, typer.Option(help='JSON lines, each {"prompt": ...} (default: the built-in 9 prompts).')
]
MinLengthOption = Annotated[
    float, typer.Option(help="Fail below this mean acceptance length (counts the bonus token).")
]
JsonReportOption = Annotated[str | None, typer.Option("--json", help="Write the JSON report to FILE, or - for stdout.")]
JunitOption = Annotated[Path | None, typer.Option(help="Write a JUnit XML report to FILE.")]
HtmlOption = Annotated[
    Path | None, typer.Option("--html", help="Write a self-contained HTML report, with charts, to FILE.")
]


class Engine(StrEnum):
    SPECDOCTOR = "specdoctor"
    VLLM = "vllm"


EngineOption = Annotated[
    Engine,
    typer.Option(
        help="Where the pair runs: specdoctor's own runtime, or the vLLM installed in this Python with specdoctor's "
        "plugin in its workers (then flags specdoctor does not declare go to vLLM as written, e.g. "
        "--max-model-len 4096; docs/vllm-plugin.md)."
    ),
]
EngineTimeoutOption = Annotated[
    float, typer.Option(min=1, help="--engine vllm: seconds vLLM may take, its starts, batteries and repair together.")
]
# What a command that takes --engine lets through for vLLM: the options it does not declare itself.
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def passed_to_engine(ctx: typer.Context, engine: Engine) -> list[str]:
    """The flags the command did not declare: vLLM's with --engine vllm, else refused as typer would."""
    if ctx.args and engine is not Engine.VLLM:
        raise SpecdoctorError(f"no such option: {ctx.args[0]} (options of vLLM's go through with --engine vllm)")
    return list(ctx.args)


# Decimal units as written, binary ones (and the bare letters, as `free -h` means them) in powers of 2.
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
SIZE_UNITS |= {f"{letter}{suffix}": 2 ** (10 * (i + 1)) for i, letter in enumerate("KMGT") for suffix in ("", "IB")}


def parse_size(text: str, flag: str) -> int:
    """A number of bytes written as `8GiB`, `500MB`, `1.5G` or `1024`."""
    number = text.strip()
    digits = number.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")
    unit = number[len(digits) :].strip().upper()
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in SIZE_UNITS or value <= 0:
        raise SpecdoctorError(f"{flag} {text!r} is not a size such as 8GiB, 500MB or 1073741824")
    return int(value * SIZE_UNITS[unit])


_FIELDS = {spec.name: spec for spec in dataclasses.fields(RuntimeOptions)}
_TYPES = typing.get_type_hints(RuntimeOptions)


def runtime_field_option(name: str, repeat: bool = False):
    """The typer annotation of one RuntimeOptions field (a list of values when `repeat`)."""
    spec = _FIELDS[name]
    single = next(arg for arg in typing.get_args(_TYPES[name]) or (_TYPES[name],) if arg is not type(None))
    kind = list[single] | None if repeat else _TYPES[name]
    return Annotated[
        kind, typer.Option(*spec.metadata["flags"], help=spec.metadata["help"], rich_help_panel=RUNTIME_PANEL)
    ]


ModelOption = runtime_field_option("model")
SpeculativeConfigOption = Annotated[
    str | None,
    typer.Option(
        help='vLLM\'s JSON, e.g. \'{"method":"mtp","num_speculative_tokens":3}\' (sets the draft tokens).',
        rich_help_panel=RUNTIME_PANEL,
    ),
]


def _parameter(name: str, default, repeat: bool) -> inspect.Parameter:
    if _FIELDS[name].metadata["required"]:
        default = inspect.Parameter.empty
    elif repeat:
        default = None
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=runtime_field_option(name, repeat)
    )


def runtime_command(repeat: tuple[str, ...] = (), **defaults):
    """Give a command every runtime option (with this command's `defaults`) plus vLLM's
    `--speculative-config`; the command receives `runtime: RuntimeOptions`, and with `repeat`
    also `sweeps: {field: [values]}` for the fields a user may give several times (bench; their
    `defaults` are lists)."""

    def decorate(command):
        hints = typing.get_type_hints(command, include_extras=True)  # the command's annotations, evaluated
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name])
            for p in inspect.signature(command).parameters.values()
            if p.name not in ("runtime", "sweeps")
        ]
        runtime = [_parameter(name, defaults.get(name, spec.default), name in repeat) for name, spec in _FIELDS.items()]
        config = inspect.Parameter(
            SPECULATIVE_CONFIG, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=SpeculativeConfigOption
        )
        parameters = [*runtime, config, *own]  # keyword-only: the order is only --help's

        @functools.wraps(command)
        def wrapper(**values):
            config_text = values.pop(SPECULATIVE_CONFIG)
            chosen = {name: values.pop(name) for name in _FIELDS}
            if config_text is not None or chosen["speculative_method"] is not None:
                # The kinds own vLLM's method names: the registry (and torch) only where a method may be given.
                from specdoctor.runtime.drafter.registry import options_from_speculative_config, speculative_method
            if config_text is not None:
                from_config = options_from_speculative_config(config_text)
                k = from_config.pop("num_speculative_tokens")
                chosen.update(from_config)
                given = chosen["num_speculative_tokens"]
                default = defaults.get("num_speculative_tokens", _FIELDS["num_speculative_tokens"].default)
                if given not in (None, default, k, [k]):
                    raise SpecdoctorError(f"--num-speculative-tokens {given} contradicts --speculative-config (k {k})")
                chosen["num_speculative_tokens"] = [k] if "num_speculative_tokens" in repeat else k
            if chosen["speculative_method"] is not None:  # as its kind names it (vLLM's MTP names: the MTP kind's)
                chosen["speculative_method"] = speculative_method(chosen["speculative_method"])
            if repeat:
                sweeps = {name: chosen[name] or list(defaults[name]) for name in repeat}
                chosen.update({name: values[0] for name, values in sweeps.items()})
                return command(runtime=RuntimeOptions(**chosen), sweeps=sweeps, **values)
            return command(runtime=RuntimeOptions(**chosen), **values)

        wrapper.__signature__ = inspect.Signature(parameters)
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        return wrapper

    return decorate
