"""The short depthwise causal convolution in front of linear-attention layers (Qwen3-Next's
Gated DeltaNet, and Mamba-2), over a flat batch of sequences each with its own state slot.

    x [T, C] (the rows of several sequences, back to back)   weight [C, K]   bias [C] or None
    conv_state [S, C, K-1]: per slot, a sequence's last K-1 inputs, oldest first
    sequence i: rows query_start[i] : query_start[i+1], state slot slots[i], and has_state[i]
                (True: start from the slot's window; False: from zeros, a prompt's first chunk)

For K = 4 and a sequence of five rows x0..x4:

    window (slot or zeros)   x[rows].T
    | s0 s1 s2 |  x0 x1 x2 x3 x4 |      = ext, [C, K-1 + rows]
    |____________|
      out[x0] = act(bias + w0 s0 + w1 s1 + w2 s2 + w3 x0), then one column to the right
    conv_state[slot] <- | x2 x3 x4 |   (always ext's last K-1 columns: after one row x0 it
                                        is | s1 s2 x0 |, the old window shifted by one)

A sequence's rows may be a whole prompt, a later chunk of one, or a single decode token: the
state carries the window across calls, so an output row depends only on its sequence's
inputs, never on where the rows were split or which sequences share the batch.

`causal_conv1d_torch` is the reference and the CPU path, with transformers' torch ops
(`causal_conv1d_fn`/`causal_conv1d_update`): F.conv1d over ext cast to the weight's dtype,
the activation, a cast to x's dtype. In float32 it equals transformers bit for bit in every
decode step, and in prefills of 2 to 15 rows (AVX2; two vector lengths). Two roundings of
transformers depend on a call's row count, which no split-invariant result can follow (the
same rows prefilled in two calls round otherwise, in transformers too); the reference keeps
its decode step's:
  - torch's CPU silu vectorises contiguous runs with an exp that puts ~4% of elements an ulp
    away from its scalar loop, and which elements fall in a vector depends on the run's
    length: transformers' prefills of 16 rows or more (AVX2) round their first rows so. The
    reference runs the scalar loop for every element, as transformers' decode step does.
  - torch convolves a one-row input (transformers' one-row prefill) by another algorithm:
    with a bias, it adds the bias after the products instead of fused, an ulp away.

`causal_conv1d` is the Triton kernel: one program per (sequence, block of channels) keeps
the window in registers while it walks the sequence's rows, accumulating in float32. In
float32 it agrees with the reference to rounding; in bfloat16 it skips the reference's
intermediate roundings to the weight's dtype.

Preconditions no check can see without a device sync: the slots of one call are distinct
and within [0, S), and query_start is non-decreasing with query_start[N] <= T. Rows past
query_start[N] get zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagefleet.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, KernelArgumentError, check_shape, check_tensor

ACTIVATIONS = ("silu", None)


def check_sequences(
    query_start: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, device: torch.device
) -> None:
    """The flat batch's description, shared by the linear-attention ops: query_start [N + 1],
    slots [N] (int32/int64), has_state [N] bool, all on `device`."""
    check_tensor("slots", slots, 1, INDEX_DTYPES, device)
    check_tensor("query_start", query_start, 1, INDEX_DTYPES, device)
    check_shape("query_start", query_start, (slots.shape[0] + 1,))
    check_tensor("has_state", has_state, 1, (torch.bool,), device)
    check_shape("has_state", has_state, tuple(slots.shape))


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    activation: str | None,
) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 2, FLOAT_DTYPES, x.device)
    num_channels, width = x.shape[1], weight.shape[1]
    check_shape("weight", weight, (num_channels, width))
    if bias is not None:
        check_tensor("bias", bias, 1, (weight.dtype,), x.device)
        check_shape("bias", bias, (num_channels,))
    # Any strides: a [S, K-1, C] buffer (channels last) viewed as [S, C, K-1] works as well.
    check_tensor("conv_state", conv_state, 3, (x.dtype,), x.device, unit_last_stride=False)
    check_shape("conv_state", conv_state, (conv_state.shape[0], num_channels, width - 1))
    check_sequences(query_start, slots, has_state, x.device)
    if activation not in ACTIVATIONS:
        raise KernelArgumentError(f"activation: {activation!r} is not one of {ACTIVATIONS}")


@triton.jit
def _causal_conv1d_kernel(
    x_ptr,
    weight_ptr,
    bias_ptr,  # [C], read only with HAS_BIAS
    conv_state_ptr,
    query_start_ptr,
    slots_ptr,
    has_state_ptr,
    out_ptr,
    num_channels,
    stride_xt,
    stride_wc,
    stride_ss,
    stride_sc,
    stride_sk,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    sequence = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = channels < num_channels
    start = tl.load(query_start_ptr + sequence).to(tl.int64)
    end = tl.load(query_start_ptr + sequence + 1).to(tl.int64)
    slot = tl.load(slots_ptr + sequence).to(tl.int64)
    has_state = tl.load(has_state_ptr + sequence)

    # window[:, j] is the input that tap j multiplies: columns 0..K-2 the previous K-1 inputs
    # (the state's layout), column K-1 the current row; columns past K stay 0, as their taps.
    taps = tl.arange(0, BLOCK_K)
    state_mask = channel_ok[:, None] & (taps < K - 1)[None, :]
    state_at = conv_state_ptr + slot * stride_ss + channels[:, None] * stride_sc + taps[None, :] * stride_sk
    window = tl.load(state_at, mask=state_mask & has_state, other=0.0).to(tl.float32)
    weight_mask = channel_ok[:, None] & (taps < K)[None, :]
    weight = tl.load(weight_ptr + channels[:, None] * stride_wc + taps[None, :], mask=weight_mask, other=0.0)
    weight = weight.to(tl.float32)
    bias = tl.zeros([BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
    newest = (taps == K - 1)[None, :]
    shift = tl.broadcast_to(tl.minimum(taps + 1, BLOCK_K - 1)[None, :], (BLOCK_C, BLOCK_K))
    for row in range(start, end):
        x = tl.load(x_ptr + row * stride_xt + channels, mask=channel_ok, other=0.0).to(tl.float32)
        window = tl.where(newest, x[:, None], window)
        acc = tl.sum(window * weight, axis=1) + bias
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + row * num_channels + channels, acc.to(out_ptr.dtype.element_ty), mask=channel_ok)
        window = tl.gather(window, shift, axis=1)  # one column left: column j takes j + 1
    # After the last shift columns 0..K-2 hold the last K-1 inputs: ext's last K-1 columns.
    tl.store(state_at, window.to(conv_state_ptr.dtype.element_ty), mask=state_mask)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    activation: str | None = "silu",
    block_channels: int = 64,
) -> torch.Tensor:
    """out [T, C] in x's dtype: the module docstring's convolution; conv_state's slots of the
    batch are overwritten with each sequence's last K-1 inputs, the other slots untouched.

    Args:
        x: [T, C], a contiguous channel dimension (rows may be strided).
        weight: [C, K] depthwise taps, oldest input first; bias: [C] in weight's dtype, or None.
        conv_state: [S, C, K-1] in x's dtype, any strides.
        query_start: [N + 1]; slots: [N]; has_state: [N] bool (see the module docstring).
        activation: "silu", or None for none.
        block_channels: channels per program (a power of 2).

    Raises:
        KernelArgumentError: a tensor of the wrong shape, dtype or device, or an unknown activation.
    """
    _check(x, weight, bias, conv_state, query_start, slots, has_state, activation)
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    num_channels, width = x.shape[1], weight.shape[1]
    if slots.shape[0] == 0 or num_channels == 0:
        return out
    _causal_conv1d_kernel[(slots.shape[0], triton.cdiv(num_channels, block_channels))](
        x,
        weight,
        bias if bias is not None else weight,
        conv_state,
        query_start,
        slots,
        has_state,
        out,
        num_channels,
        x.stride(0),
        weight.stride(0),
        *conv_state.stride(),
        K=width,
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        BLOCK_C=block_channels,
        BLOCK_K=triton.next_power_of_2(width),
    )
    return out


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """The reference, and the CPU path: same arguments and result as `causal_conv1d`, one
    F.conv1d per sequence as transformers computes it."""
    _check(x, weight, bias, conv_state, query_start, slots, has_state, activation)
    num_channels, width = x.shape[1], weight.shape[1] - 1
    out = torch.zeros_like(x)
    bounds = query_start.tolist()
    for sequence, (slot, stored) in enumerate(zip(slots.tolist(), has_state.tolist(), strict=True)):
        start, end = bounds[sequence], bounds[sequence + 1]
        window = conv_state[slot] if stored else x.new_zeros(num_channels, width)
        ext = torch.cat([window, x[start:end].T], dim=-1)
        if end > start:
            y = F.conv1d(ext.to(weight.dtype).unsqueeze(0), weight.unsqueeze(1), bias, groups=num_channels)[0].T
            out[start:end] = (_silu_by_element(y) if activation == "silu" else y).to(x.dtype)
        conv_state[slot] = ext[:, ext.shape[1] - width :]
    return out


def _silu_by_element(y: torch.Tensor) -> torch.Tensor:
    """F.silu by torch's scalar loop for every element (see the module docstring): through a
    stride-2 view, which the vectorised loop does not take."""
    spread = y.new_zeros(*y.shape, 2)
    spread[..., 0] = y
    return F.silu(spread[..., 0])
