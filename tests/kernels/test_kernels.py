"""Every Triton kernel against its torch reference, on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, set in conftest), with outputs poisoned before each run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specdoctor import kernels
from specdoctor.errors import SpecdoctorError
from specdoctor.kernels import reference, triton_mtp, triton_quant, triton_stats, triton_verify

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton is not installed on this platform"
)


def planted(shape, dtype, seed):
    """Random values with NaN, +Inf, -Inf and exact zeros planted at random places."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * 3
    flat = x.view(-1)
    if flat.numel() >= 8:
        index = torch.randperm(flat.numel(), generator=generator)
        flat[index[:3]] = float("nan")
        flat[index[3:5]] = float("inf")
        flat[index[5]] = float("-inf")
        flat[index[6:8]] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (4095,), (4097,), (3, 1000), (257, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_stats_kernel_matches_reference(shape, dtype):
    x = planted(shape, dtype, seed=sum(shape))
    ours, expected = triton_stats.tensor_stats(x), reference.tensor_stats(x)
    for field in ("nan", "posinf", "neginf", "zeros", "min", "max", "absmax"):
        assert ours[field] == expected[field], field
    for field in ("sum", "sumsq"):
        assert ours[field] == pytest.approx(expected[field], rel=1e-4, abs=1e-3), field


@pytest.mark.parametrize("rows, width", [(5, 33), (64, 1500), (1, 1)])
def test_row_fingerprints_kernel_matches_reference(rows, width):
    x = planted((rows, width), torch.float32, seed=rows * width)
    selected = torch.tensor([0, rows - 1, rows // 2, 0])  # repeats allowed
    projection = torch.randn(width, generator=torch.Generator().manual_seed(1))
    ours = triton_stats.row_fingerprints(x, selected, projection)
    expected = reference.row_fingerprints(x, selected, projection)
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
    empty = triton_stats.row_fingerprints(x, selected[:0], projection)
    assert empty[0].numel() == 0


def ragged_batch(counts: list[int], vocab: int, seed: int, match: float = 0.7):
    generator = torch.Generator().manual_seed(seed)
    total = sum(counts)
    target = torch.randint(0, vocab, (total,), generator=generator)
    drafts = torch.where(
        torch.rand(total, generator=generator) < match, target, torch.randint(0, vocab, (total,), generator=generator)
    )
    cu = torch.tensor(counts, dtype=torch.long).cumsum(0)
    bonus = torch.randint(0, vocab, (len(counts),), generator=generator)
    return drafts, cu, target, bonus


@pytest.mark.parametrize("counts", [[], [0], [3], [0, 0, 0], [5, 0, 2, 8, 1], [1] * 17, [8, 8, 8, 8]])
def test_greedy_verification_kernel_equals_reference(counts):
    drafts, cu, target, bonus = ragged_batch(counts, vocab=5, seed=len(counts))
    max_k = max(counts, default=0)
    ours = triton_verify.rejection_greedy(drafts, cu, target, bonus, max_k)
    assert torch.equal(ours, reference.rejection_greedy(drafts, cu, target, bonus, max_k))


def random_inputs(counts: list[int], vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    total = sum(counts)
    q = torch.softmax(torch.randn(total, vocab, generator=generator) * 2, -1)
    p = torch.softmax(torch.randn(total, vocab, generator=generator) * 2, -1)
    q[0:1, :3] = 0.0  # a draft distribution with zero mass on some tokens
    drafts = torch.multinomial(q, 1, generator=generator).squeeze(1) if total else torch.zeros(0, dtype=torch.long)
    uniform = torch.rand(total, generator=generator)
    exponential = torch.empty(total, vocab).exponential_(generator=generator)
    bonus = torch.randint(0, vocab, (len(counts),), generator=generator)
    return drafts, torch.tensor(counts, dtype=torch.long).cumsum(0), q, p, uniform, exponential, bonus


@pytest.mark.parametrize("counts, vocab", [([], 7), ([0, 2], 7), ([4, 1, 0, 3], 1500), ([2] * 9, 33)])
def test_random_verification_kernels_equal_reference_for_fixed_noise(counts, vocab):
    drafts, cu, q, p, uniform, exponential, bonus = random_inputs(counts, vocab, seed=vocab)
    recovered = triton_verify.sample_recovered(drafts, q, p, exponential)
    assert torch.equal(recovered, reference.sample_recovered(drafts, q, p, exponential))
    max_k = max(counts, default=0)
    ours = triton_verify.rejection_random(drafts, cu, q, p, uniform, recovered, bonus, max_k)
    assert torch.equal(ours, reference.rejection_random(drafts, cu, q, p, uniform, recovered, bonus, max_k))


def test_recovered_tokens_follow_the_residual_distribution():
    """The exponential race samples normalise(max(p - q, 0)); checked on many draws of one position."""
    generator = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(6, generator=generator), -1)
    q = torch.softmax(torch.randn(6, generator=generator), -1)
    n = 3000
    exponential = torch.empty(n, 6).exponential_(generator=generator)
    tokens = triton_verify.sample_recovered(
        torch.zeros(n, dtype=torch.long), q.expand(n, -1), p.expand(n, -1), exponential
    )
    residual = (p - q).clamp_min(0)
    residual /= residual.sum()
    frequencies = torch.bincount(tokens, minlength=6).float() / n
    assert ((frequencies - residual).abs() <= 5 * (residual * (1 - residual) / n).sqrt() + 1e-9).all()


@pytest.mark.parametrize("shape", [(0, 33), (1, 64), (3, 5, 192), (7, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mtp_input_matches_reference(shape, dtype):
    generator = torch.Generator().manual_seed(shape[-1])
    embeds = torch.randn(shape, generator=generator).to(dtype)
    hidden = (torch.randn(shape, generator=generator) * 4).to(dtype)
    positions = torch.randint(0, 3, shape[:-1], generator=generator)  # several position-0 rows
    enorm = (1 + 0.1 * torch.randn(shape[-1], generator=generator)).to(dtype)
    hnorm = (1 + 0.1 * torch.randn(shape[-1], generator=generator)).to(dtype)
    ours = triton_mtp.mtp_input(embeds, hidden, positions, enorm, hnorm, 1e-5)
    expected = reference.mtp_input(embeds, hidden, positions, enorm, hnorm, 1e-5)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(ours, expected, **tolerance)


def test_dispatcher_picks_torch_on_cpu_and_obeys_the_override(monkeypatch):
    x = torch.zeros(3)
    monkeypatch.delenv("SPECDOCTOR_KERNELS", raising=False)
    assert kernels.backend(x) == "torch"
    monkeypatch.setenv("SPECDOCTOR_KERNELS", "triton")
    assert kernels.backend(x) == "triton"
    monkeypatch.setenv("SPECDOCTOR_KERNELS", "cuda-magic")
    with pytest.raises(SpecdoctorError, match="SPECDOCTOR_KERNELS"):
        kernels.backend(x)


def test_runtime_and_checks_run_on_the_triton_kernels(monkeypatch):
    """The speculative step and the statistics check go through the dispatcher: forced to Triton
    (interpreted), they give the same tokens, acceptance and statistics as the torch path."""
    from specdoctor.runtime.decode.batch import decode_batch
    from specdoctor.runtime.decode.requests import GenerateRequest
    from specdoctor.runtime.drafter.measure import tensor_stats
    from specdoctor.runtime.options import RuntimeOptions
    from specdoctor.runtime.rank_loading import load_rank

    model, _ = load_rank(RuntimeOptions("demo"), 0)
    request = GenerateRequest([[5, 6, 7, 8], [100, 101]], 6, num_speculative_tokens=2)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SPECDOCTOR_KERNELS", backend)
        result = decode_batch(model, request)
        results[backend] = (result.tokens, result.metrics, tensor_stats(model.drafter.embed_tokens.weight))
    model.comm.close()
    assert results["torch"][:2] == results["triton"][:2]
    for field, value in results["torch"][2].to_dict().items():
        assert getattr(results["triton"][2], field) == pytest.approx(value, rel=1e-4), field


@pytest.mark.slow  # the interpreter runs every quantised linear of the demo: half a minute
def test_packed_weights_run_on_the_w4a16_kernel(monkeypatch):
    """demo-w4a16 with its weights packed: forced to Triton (interpreted), the quantised linears go through the
    W4A16 kernel (every one outside the routed experts, and the experts routed to) and the speculative step
    gives the torch path's tokens and acceptance."""
    from specdoctor.runtime.decode.batch import decode_batch
    from specdoctor.runtime.decode.requests import GenerateRequest
    from specdoctor.runtime.models.packed import PackedLinear
    from specdoctor.runtime.options import RuntimeOptions
    from specdoctor.runtime.rank_loading import load_rank

    model, _ = load_rank(RuntimeOptions("demo-w4a16"), 0)
    request = GenerateRequest([[5, 6, 7, 8]], 3, num_speculative_tokens=2)
    calls = []
    kernel = triton_quant.w4a16_matmul
    monkeypatch.setattr(triton_quant, "w4a16_matmul", lambda *args: calls.append(args[1].data_ptr()) or kernel(*args))
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SPECDOCTOR_KERNELS", backend)
        result = decode_batch(model, request)
        results[backend] = (result.tokens, result.metrics)
    model.comm.close()
    assert results["torch"] == results["triton"]
    packed = {
        name: m.part("packed").data_ptr() for name, m in model.stage.named_modules() if isinstance(m, PackedLinear)
    }
    outside_experts = {pointer for name, pointer in packed.items() if ".experts." not in name}
    assert outside_experts and outside_experts <= set(calls) <= set(packed.values())
    assert set(calls) - outside_experts  # routed experts too


def random_words(shape, generator) -> torch.Tensor:
    """int32 words with every 4-bit field random (the whole code space, signs included)."""
    return torch.randint(-(2**31), 2**31, shape, generator=generator, dtype=torch.int64).to(torch.int32)


def assert_matmul_close(ours, expected):
    """Summation order differs (tiles of 32 against one matmul): fp32 to 1e-5 of the largest output;
    a bf16 output to one bf16 step of it."""
    step = 2**-7 if expected.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(ours.float(), expected.float(), rtol=0, atol=step * float(expected.abs().max()))


# (M tokens, N outputs, K inputs, group): one token; groups that straddle the kernel's 32-wide K tiles (48);
# N and M that do not fill a tile
QUANT_SHAPES = [(1, 8, 32, 32), (5, 72, 96, 48), (17, 200, 160, 32)]


@pytest.mark.parametrize("m, n, k, group", QUANT_SHAPES)
@pytest.mark.parametrize("packing, with_zeros", [("pack-quantized", False), ("pack-quantized", True), ("awq", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a16_matmul_kernel_matches_reference(m, n, k, group, packing, with_zeros, dtype):
    generator = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=generator).to(dtype)
    groups = -(-k // group)
    if packing == "awq":
        packed, zeros = random_words((k, n // 8), generator), random_words((groups, n // 8), generator)
        scales = (torch.rand(groups, n, generator=generator) * 0.1).half()
    else:
        packed = random_words((n, k // 8), generator)
        zeros = random_words((-(-n // 8), groups), generator) if with_zeros else None
        scales = (torch.rand(n, groups, generator=generator) * 0.1).to(dtype)
    ours = triton_quant.w4a16_matmul(x, packed, scales, zeros, group, packing)
    expected = reference.w4a16_matmul(x, packed, scales, zeros, group, packing)
    assert ours.dtype == expected.dtype == dtype
    assert_matmul_close(ours, expected)


def fp8_bytes(shape, generator) -> torch.Tensor:
    """Random float8_e4m3fn values, NaN codes (0x7F, 0xFF) left out: one would poison a whole output column."""
    codes = torch.randint(0, 254, shape, generator=generator)
    codes = codes + (codes >= 0x7F).long()
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("m, n, k, block", [(3, 70, 100, (32, 64)), (16, 128, 256, (128, 128)), (1, 9, 40, (8, 16))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_matmul_kernel_matches_reference_with_partial_blocks(m, n, k, block, dtype):
    generator = torch.Generator().manual_seed(n * k)
    x = torch.randn(m, k, generator=generator).to(dtype)
    weight = fp8_bytes((n, k), generator)
    scale_inv = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=generator) * 0.01
    ours = triton_quant.fp8_block_matmul(x, weight, scale_inv, block)
    assert_matmul_close(ours, reference.fp8_block_matmul(x, weight, scale_inv, block))


def test_fp8_kernel_decodes_every_e4m3_code_exactly():
    """The kernel decodes float8 bytes itself (Triton has no e4m3 type on sm_80): each of the 256 codes, as
    one product with 1.0, equals torch's float8_e4m3fn conversion, NaN codes included."""
    codes = torch.arange(256).to(torch.uint8).view(torch.float8_e4m3fn)[:, None]  # [N = 256, K = 1]
    ours = triton_quant.fp8_block_matmul(torch.ones(1, 1), codes, torch.ones(1, 1), (256, 1))[0]
    expected = codes.float()[:, 0]
    assert torch.equal(ours.isnan(), expected.isnan()) and int(expected.isnan().sum()) == 2
    assert torch.equal(ours.nan_to_num(), expected.nan_to_num())


def test_every_kernel_compiles_for_a100_and_h100():
    """triton.compile for sm_80 and sm_90 (no GPU needed) of every kernel in the package as its wrapper
    launches it at a real model's sizes: a kernel the interpreter runs but a GPU compiler rejects fails here."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # the interpreter's functions cannot be compiled
    result = subprocess.run(
        [sys.executable, "-m", "specdoctor.kernels.aot"], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    compiled = {(row["kernel"], row["sm"]) for row in report["compiled"] if row["cubin_bytes"] > 0}
    assert len(report["kernels"]) >= 8
    assert compiled == {(kernel, sm) for kernel in report["kernels"] for sm in (80, 90)}
