"""Triton: GEMMs on quantised weights, dequantising each tile in registers (docs/quantization.md).

`w4a16_matmul`: x [M, K] times a 4-bit weight, both packings: compressed-tensors `pack-quantized`
(words along K, value i of a word at bits 4i, an offset of 8, optional zero points packed along N)
and AutoAWQ GEMM (words along N in the order 0 2 4 6 1 3 5 7, unsigned zero points).
`fp8_block_matmul`: x [M, K] times a float8_e4m3fn weight [N, K] with one scale per block (partial edge
blocks included), its bytes decoded in the kernel.
Each dequantised tile is rounded to the scales' dtype as the references do, and accumulated in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdoctor.kernels.buffers import output

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 values rounded to `dtype` (to nearest, ties to even), kept in fp32. bf16 by bits: Triton's
    interpreter, which the tests run, truncates in its bf16 cast where a GPU and torch round."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return x.to(dtype).to(tl.float32)


@triton.jit
def _tile_dot(acc, x, w):
    """acc + x @ w with w rounded to x's dtype first (as the runtime holds weights), multiplied in fp32 without
    TF32: bf16 and fp16 products are exact there, so only the summation order differs from the reference.
    fp32 rather than bf16 tensor-core dots because these are decode GEMMs, bound by streaming the weight
    (and Triton's interpreter, which the tests run, computes bf16 dots wrongly)."""
    return tl.dot(x.to(tl.float32), _round(w, x.dtype), acc, input_precision="ieee")


@triton.jit
def _load_x(x_ptr, rows, ks, M, K):
    """The [BM, BK] tile of the activations x [M, K], zero outside it."""
    return tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)


@triton.jit
def _store_tile(out_ptr, acc, rows, cols, M, N):
    """The fp32 accumulator rounded to the output's dtype and stored where it lies inside out [M, N]."""
    out = _round(acc, out_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)  # exact: already representable
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _w4a16_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, group_size, words_per_row, groups,
    AWQ: tl.constexpr, HAS_ZERO: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for start in range(0, K, BK):
        ks = start + tl.arange(0, BK)
        inside = (ks[:, None] < K) & (cols[None, :] < N)
        x = _load_x(x_ptr, rows, ks, M, K)
        group = ks // group_size
        if AWQ:  # qweight [K, N/8]; column c sits in slot (c % 2) * 4 + (c % 8) // 2 of its word
            shift = (((cols % 8) % 2) * 4 + (cols % 8) // 2) * 4
            words = tl.load(w_ptr + ks[:, None] * (N // 8) + (cols // 8)[None, :], mask=inside, other=0)
            values = (words >> shift[None, :]) & 0xF
            zero_words = tl.load(zero_ptr + group[:, None] * (N // 8) + (cols // 8)[None, :], mask=inside, other=0)
            zeros = (zero_words >> shift[None, :]) & 0xF
            scale = tl.load(scale_ptr + group[:, None] * N + cols[None, :], mask=inside, other=0.0)
        else:  # weight_packed [N, words_per_row]; scales [N, groups]; zero points [ceil(N / 8), groups]
            words = tl.load(w_ptr + cols[None, :] * words_per_row + (ks // 8)[:, None], mask=inside, other=0)
            values = ((words >> ((ks % 8) * 4)[:, None]) & 0xF) - 8
            zeros = tl.zeros((BK, BN), dtype=tl.int32)
            if HAS_ZERO:
                zero_words = tl.load(zero_ptr + (cols // 8)[None, :] * groups + group[:, None], mask=inside, other=0)
                zeros = ((zero_words >> ((cols % 8) * 4)[None, :]) & 0xF) - 8
            scale = tl.load(scale_ptr + cols[None, :] * groups + group[:, None], mask=inside, other=0.0)
        weight = _round((values - zeros).to(tl.float32) * scale.to(tl.float32), scale.dtype)  # [BK, BN]
        acc = _tile_dot(acc, x, weight)
    _store_tile(out_ptr, acc, rows, cols, M, N)


@triton.jit
def _e4m3_to_fp32(bits):
    """float8_e4m3fn bytes to fp32, decoded bit by bit: Triton has no e4m3 type on sm_80 (A100), where
    engines run FP8 checkpoints weight-only for the same reason. Exact: powers of two built from bits."""
    code = bits.to(tl.int32)
    exponent = (code >> 3) & 0xF
    mantissa = (code & 0x7).to(tl.float32) / 8.0
    power = ((tl.maximum(exponent, 1) + 120) << 23).to(tl.float32, bitcast=True)  # 2^(max(e, 1) - 7)
    value = tl.where(exponent == 0, mantissa, 1.0 + mantissa) * power
    value = tl.where((code & 0x7F) == 0x7F, float("nan"), value)
    return tl.where((code & 0x80) != 0, -value, value)


@triton.jit
def _fp8_block_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, block_n, block_k, scale_columns,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for start in range(0, K, BK):
        ks = start + tl.arange(0, BK)
        inside = (ks[:, None] < K) & (cols[None, :] < N)
        x = _load_x(x_ptr, rows, ks, M, K)
        weight = _e4m3_to_fp32(tl.load(w_ptr + cols[None, :] * K + ks[:, None], mask=inside, other=0))
        scale_at = (cols // block_n)[None, :] * scale_columns + (ks // block_k)[:, None]
        scale = tl.load(scale_ptr + scale_at, mask=inside, other=0.0).to(tl.float32)
        acc = _tile_dot(acc, x, weight * scale)
    _store_tile(out_ptr, acc, rows, cols, M, N)


def _grid(rows: int, columns: int):
    return (triton.cdiv(rows, BLOCK_M), triton.cdiv(columns, BLOCK_N))


def w4a16_matmul(x, packed, scales, zeros, group_size: int, packing: str) -> torch.Tensor:
    x = x.contiguous()
    rows, width = x.shape
    awq = packing == "awq"
    columns = packed.shape[1] * 8 if awq else packed.shape[0]
    out = output((rows, columns), x.dtype, x.device)
    if rows and columns:
        _w4a16_kernel[_grid(rows, columns)](
            x, packed.contiguous(), scales.contiguous(), packed if zeros is None else zeros.contiguous(), out,
            rows, columns, width, group_size, packed.shape[1], scales.shape[0 if awq else 1],
            AWQ=awq, HAS_ZERO=zeros is not None, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        )  # fmt: skip
    return out


def fp8_block_matmul(x, weight, scale_inv, block: tuple[int, int]) -> torch.Tensor:
    x = x.contiguous()
    rows, width = x.shape
    columns = weight.shape[0]
    out = output((rows, columns), x.dtype, x.device)
    if rows and columns:
        _fp8_block_kernel[_grid(rows, columns)](
            x, weight.contiguous().view(torch.uint8), scale_inv.contiguous(), out, rows, columns, width,
            block[0], block[1], scale_inv.shape[1], BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
        )  # fmt: skip
    return out
