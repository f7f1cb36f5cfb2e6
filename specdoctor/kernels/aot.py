"""Ahead-of-time compilation of every Triton kernel in the package for the GPUs users run (sm_80: A100,
sm_90: H100), on any machine: `triton.compile` with a `GPUTarget` builds PTX and a cubin without a GPU.

Each kernel is compiled as its wrapper launches it at a real model's shapes and dtypes: the wrapper runs
on CPU tensors with the kernel swapped for a recorder, and the recorded arguments give the signature and
the constexprs (block sizes derived from the shapes included). The interpreter runs kernels as Python and
hides what only a compiler rejects (shared memory, dtype rules of tl.dot, register pressure); this does not.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

KERNEL_MODULES = ("triton_stats", "triton_verify", "triton_mtp", "triton_quant")
ARCHITECTURES = (80, 90)  # compute capabilities: A100 (the seed deployment's), H100/H200
TRITON_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
    torch.int64: "i64", torch.int32: "i32", torch.uint8: "u8", torch.bool: "i1",
}  # fmt: skip
# Sizes of the models users deploy: GLM-5's hidden size and vocabulary, a W4A16 expert's projection.
HIDDEN, VOCAB, INTERMEDIATE, TOKENS = 6144, 154880, 2048, 16


@dataclass
class Launch:
    kernel: str  # module.function
    variant: str  # which call of the wrapper
    signature: dict[str, str]
    constexprs: dict[str, object]


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kwargs)` records the call instead of running it."""

    def __init__(self, fn, name: str, variant: Callable[[], str], launches: list[Launch]):
        self.fn, self.name, self.variant, self.launches = fn, name, variant, launches

    def __getitem__(self, _grid):
        return self.record

    def record(self, *args, **kwargs) -> None:
        values = dict(zip(self.fn.arg_names, args, strict=False)) | kwargs  # trailing arguments by keyword
        constexpr_names = {self.fn.arg_names[i] for i in self.fn.constexprs}
        signature = {
            name: "constexpr" if name in constexpr_names else _type(values[name]) for name in self.fn.arg_names
        }
        constexprs = {name: values[name] for name in constexpr_names}
        self.launches.append(Launch(self.name, self.variant(), signature, constexprs))


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TRITON_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


def _calls() -> list[tuple[str, Callable[[], object]]]:
    """(variant, call) for every wrapper at real sizes; each call launches one kernel."""
    from specdoctor.kernels import triton_mtp, triton_quant, triton_stats, triton_verify

    def rand(*shape, dtype=torch.float32):
        return torch.randn(shape).to(dtype)

    def ints(*shape, high=2**31 - 1, dtype=torch.int32):
        return torch.randint(0, high, shape, dtype=torch.int64).to(dtype)

    bf16 = torch.bfloat16
    drafts, probs, cu = ints(TOKENS, high=VOCAB, dtype=torch.int64), rand(TOKENS, VOCAB), ints(4, high=TOKENS)
    x = rand(TOKENS, HIDDEN, dtype=bf16)
    packed, scales = ints(INTERMEDIATE, HIDDEN // 8), rand(INTERMEDIATE, HIDDEN // 128, dtype=bf16)
    zeros = ints(INTERMEDIATE // 8, HIDDEN // 128)
    awq = ints(HIDDEN, INTERMEDIATE // 8), rand(HIDDEN // 128, INTERMEDIATE, dtype=torch.float16)
    awq_zeros = ints(HIDDEN // 128, INTERMEDIATE // 8)
    fp8 = rand(INTERMEDIATE, HIDDEN).to(torch.float8_e4m3fn), rand(INTERMEDIATE // 128, HIDDEN // 128)
    norm, positions = rand(HIDDEN, dtype=bf16), torch.arange(TOKENS)
    return [
        ("embedding bf16", lambda: triton_stats.tensor_stats(rand(VOCAB, 64, dtype=bf16))),
        ("fingerprints bf16", lambda: triton_stats.row_fingerprints(x, torch.arange(8), rand(HIDDEN))),
        ("greedy k 5", lambda: triton_verify.rejection_greedy(drafts, cu, drafts, drafts[:4], 5)),
        ("random k 5", lambda: triton_verify.rejection_random(drafts, cu, probs, probs, rand(TOKENS), drafts,
                                                                drafts[:4], 5)),
        ("recovered", lambda: triton_verify.sample_recovered(drafts, probs, probs, rand(TOKENS))),
        ("mtp input bf16", lambda: triton_mtp.mtp_input(x, x, positions, norm, norm, 1e-5)),
        ("w4a16 pack-quantized", lambda: triton_quant.w4a16_matmul(x, packed, scales, None, 128, "pack-quantized")),
        ("w4a16 zero points", lambda: triton_quant.w4a16_matmul(x, packed, scales, zeros, 128, "pack-quantized")),
        ("w4a16 awq fp16", lambda: triton_quant.w4a16_matmul(x.half(), *awq, awq_zeros, 128, "awq")),
        ("fp8 block 128x128", lambda: triton_quant.fp8_block_matmul(x, *fp8, (128, 128))),
    ]  # fmt: skip


def launches() -> list[Launch]:
    """Every kernel launch the wrappers make at real sizes, recorded (nothing runs)."""
    recorded: list[Launch] = []
    current = {"variant": ""}
    saved = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"specdoctor.kernels.{name}")
        for attribute, value in vars(module).items():
            if _is_kernel(attribute, value):
                saved.append((module, attribute, value))
                setattr(
                    module, attribute, _Recorder(value, f"{name}.{attribute}", lambda: current["variant"], recorded)
                )
    try:
        for variant, call in _calls():
            current["variant"] = variant
            call()
    finally:
        for module, attribute, value in saved:
            setattr(module, attribute, value)
    return recorded


def _is_kernel(attribute: str, value) -> bool:
    return type(value).__name__ == "JITFunction" and attribute.endswith("_kernel")


def kernel_names() -> set[str]:
    """Every launchable kernel in the package (module.function), for completeness checks."""
    names = set()
    for name in KERNEL_MODULES:
        module = importlib.import_module(f"specdoctor.kernels.{name}")
        names |= {
            f"{name}.{a}"
            for a, v in vars(module).items()
            if type(v).__name__ == "JITFunction" and a.endswith("_kernel")
        }
    return names


def compile_launch(launch: Launch, capability: int):
    """The compiled kernel (PTX, cubin, metadata) for a CUDA GPU of this compute capability."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module_name, function = launch.kernel.split(".")
    fn = getattr(importlib.import_module(f"specdoctor.kernels.{module_name}"), function)
    source = ASTSource(fn, launch.signature, launch.constexprs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32))


def ptxas_usage(ptx: str, capability: int) -> dict[str, int]:
    """Registers per thread and spill bytes, as the bundled ptxas reports them for this PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.ptx"
        path.write_text(ptx)
        command = [get_ptxas(capability).path, "-v", f"--gpu-name=sm_{capability}a" if capability == 90 else
                   f"--gpu-name=sm_{capability}", str(path), "-o", str(path.with_suffix(".cubin"))]  # fmt: skip
        report = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return {
        "registers": int(registers.group(1)) if registers else -1,
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else 0,
    }


def main() -> None:
    """Compile every launch for every architecture; print one JSON row per compile (CI runs this)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--usage", action="store_true", help="also run ptxas -v for registers and spills")
    usage = parser.parse_args().usage
    recorded = launches()
    rows = []
    for launch in recorded:
        for capability in ARCHITECTURES:
            compiled = compile_launch(launch, capability)
            row = {"kernel": launch.kernel, "variant": launch.variant, "sm": capability,
                   "shared_bytes": compiled.metadata.shared, "cubin_bytes": len(compiled.asm["cubin"])}  # fmt: skip
            rows.append(row | (ptxas_usage(compiled.asm["ptx"], capability) if usage else {}))
    print(json.dumps({"kernels": sorted(kernel_names()), "compiled": rows}))


if __name__ == "__main__":
    main()
