"""x @ W.T with W in GGML's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), as
engine/layers/quantized.py stores them, for CUDA: the compiled CPU operator's counterpart.

Every weight is unsigned, w = scale * u + min per group of 32 along in_features, or of 16
(Q6_K) (4-bit: a block's 16 bytes hold its elements 0-15 in the low nibbles and 16-31 in
the high ones; 8-bit: one byte each). One program per (row tile, output tile) walks the blocks,
dequantizes a [BLOCK_N, 32] tile into registers and multiplies it in float32 (IEEE, as the
attention kernels do), whatever the activations' dtype: the weight crosses memory at 4-8
bits, which is what bounds a decode step. `quantized_linear_torch` (engine/layers/quantized.py), which dequantizes
the whole matrix to float32 first, is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.kernels.checks import KernelArgumentError, check_tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANT_BLOCK = 32


@triton.jit
def _quantized_matmul_kernel(
    x_ptr,
    quants_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,
    rows,
    out_features,
    num_blocks,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_om,
    FOUR_BIT: tl.constexpr,
    GROUPS_PER_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    ms = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    elements = tl.arange(0, 32)
    row_mask, out_mask = ms < rows, ns < out_features
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for block in range(0, num_blocks):
        x = tl.load(x_ptr + ms[:, None] * stride_xm + block * 32 + elements[None, :], mask=row_mask[:, None], other=0.0)
        if FOUR_BIT:
            offsets = ns[:, None] * stride_qn + block * 16 + (elements % 16)[None, :]
            packed = tl.load(quants_ptr + offsets, mask=out_mask[:, None], other=0)
            unsigned = (packed >> ((elements // 16) * 4)[None, :]) & 0xF
        else:
            offsets = ns[:, None] * stride_qn + block * 32 + elements[None, :]
            unsigned = tl.load(quants_ptr + offsets, mask=out_mask[:, None], other=0)
        if GROUPS_PER_BLOCK == 1:
            scales = tl.load(scales_ptr + ns * stride_sn + block, mask=out_mask, other=0.0).to(tl.float32)[:, None]
            mins = tl.load(mins_ptr + ns * stride_sn + block, mask=out_mask, other=0.0).to(tl.float32)[:, None]
        else:  # each element's group: [BLOCK_N, 32] loads of the block's scales and mins
            element_groups = elements // (32 // GROUPS_PER_BLOCK)
            groups = ns[:, None] * stride_sn + block * GROUPS_PER_BLOCK + element_groups[None, :]
            scales = tl.load(scales_ptr + groups, mask=out_mask[:, None], other=0.0).to(tl.float32)
            mins = tl.load(mins_ptr + groups, mask=out_mask[:, None], other=0.0).to(tl.float32)
        weight = unsigned.to(tl.float32) * scales + mins
        acc += tl.dot(x.to(tl.float32), tl.trans(weight), input_precision="ieee")
    out_offsets = ms[:, None] * stride_om + ns[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & out_mask[None, :])


def quantized_matmul(
    x: torch.Tensor, quants: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, four_bit: bool
) -> torch.Tensor:
    """x: [rows, in] (float32/bfloat16/float16, unit last stride); quants: uint8 [out, in / 2]
    (4-bit) or [out, in] (8-bit); scales, mins: float16 [out, in / 32], or [out, in / 16]
    (8-bit only) -> [rows, out] in x's dtype."""
    check_tensor("x", x, 2, FLOAT_DTYPES, unit_last_stride=True)
    check_tensor("quants", quants, 2, (torch.uint8,), x.device, unit_last_stride=True)
    check_tensor("scales", scales, 2, (torch.float16,), x.device, unit_last_stride=True)
    check_tensor("mins", mins, 2, (torch.float16,), x.device, unit_last_stride=True)
    rows, in_features = x.shape
    out_features, num_groups = scales.shape
    groups_per_block = 2 if num_groups * 16 == in_features and not four_bit else 1
    num_blocks = num_groups // groups_per_block
    if in_features != num_blocks * QUANT_BLOCK or mins.shape != scales.shape or scales.stride() != mins.stride():
        raise KernelArgumentError(f"scales/mins {tuple(scales.shape)} do not fit x {tuple(x.shape)} in groups")
    if quants.shape != (out_features, in_features // 2 if four_bit else in_features):
        raise KernelArgumentError(f"quants {tuple(quants.shape)} do not fit {out_features} x {in_features} weights")
    out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    # One tile shape for every row count: a row's sums never depend on how many rows share
    # the step (batch invariance).
    block_m, block_n = 16, 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))
    _quantized_matmul_kernel[grid](
        x,
        quants,
        scales,
        mins,
        out,
        rows,
        out_features,
        num_blocks,
        x.stride(0),
        quants.stride(0),
        scales.stride(0),
        out.stride(0),
        FOUR_BIT=four_bit,
        GROUPS_PER_BLOCK=groups_per_block,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    return out
