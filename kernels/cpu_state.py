"""The state layers' three recurrences compiled for the CPU (csrc/cpu_state.cpp, built by
cpu_ops.py): the causal conv1d, the gated delta rule and the selective scan, each with its
torch reference's arguments and result, and that reference as the fallback.

Why: the references walk a batch's row positions in a Python loop (kernels/state_rows.py),
a handful of small torch ops per position, so a prefill of a few hundred rows spends most of
its time in the interpreter and in dispatch. The operators walk each sequence's rows in a
C++ loop instead, sequences and heads (channel blocks for the conv) spread over torch's
threads.

Exactness: the operators agree with the references to float32 rounding (their multiply-adds
are fused and their sums run in another order; bfloat16 rounds where the references round).
Split and batch invariance hold bit for bit: one work item walks one sequence's rows in
order with arithmetic fixed by the state's shape alone, so a row's output and the final
state are the same bits whether the rows come in one call or several, alone or batched.

The operators take float32 and bfloat16 (the conv with weight and bias in x's dtype, the
delta rule with value in query's); other dtypes, other devices, or no compiled operators
(`cpu_ops.load()` False) take the reference.
"""

from __future__ import annotations

import torch

from pagefleet.kernels import cpu_ops
from pagefleet.kernels.causal_conv1d import _check as _check_conv
from pagefleet.kernels.causal_conv1d import causal_conv1d_torch
from pagefleet.kernels.gated_delta_rule import _check as _check_rule
from pagefleet.kernels.gated_delta_rule import gated_delta_rule_torch
from pagefleet.kernels.selective_scan import NO_LIMIT, selective_scan_torch
from pagefleet.kernels.selective_scan import _check as _check_scan

COMPILED_DTYPES = (torch.float32, torch.bfloat16)


def _compiled(first: torch.Tensor, *alike: torch.Tensor | None) -> bool:
    """Whether the operator takes these inputs: on the CPU, float32 or bfloat16, `alike` in
    `first`'s dtype, and the operators loaded (built on the first call)."""
    return (
        first.device.type == "cpu"
        and first.dtype in COMPILED_DTYPES
        and all(tensor is None or tensor.dtype == first.dtype for tensor in alike)
        and cpu_ops.load()
    )


def causal_conv1d_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """`causal_conv1d_torch`'s arguments and result: out [T, C] in x's dtype; conv_state's
    slots of the batch are overwritten with each sequence's last K-1 inputs.

    Raises:
        KernelArgumentError: a tensor of the wrong shape, dtype or device, or an unknown activation.
    """
    _check_conv(x, weight, bias, conv_state, query_start, slots, has_state, activation)
    if not _compiled(x, weight, bias):
        return causal_conv1d_torch(x, weight, bias, conv_state, query_start, slots, has_state, activation)
    return torch.ops.pagefleet.causal_conv1d_state(
        x, weight, bias, conv_state, query_start, slots, has_state, activation
    )


def gated_delta_rule_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """`gated_delta_rule_torch`'s arguments and result: out [T, Hv, Dv] in value's dtype;
    state's slots of the batch are overwritten with each sequence's final state.

    Raises:
        KernelArgumentError: a tensor of the wrong shape, dtype or device.
    """
    _check_rule(query, key, value, g, beta, state, query_start, slots, has_state)
    if not _compiled(query, value):
        return gated_delta_rule_torch(query, key, value, g, beta, state, query_start, slots, has_state, use_qk_l2norm)
    return torch.ops.pagefleet.gated_delta_rule_state(
        query, key, value, g, beta, state, query_start, slots, has_state, use_qk_l2norm
    )


def selective_scan_cpu(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    dt_limit: tuple[float, float] = NO_LIMIT,
) -> torch.Tensor:
    """`selective_scan_torch`'s arguments and result: y [T, H, P] in x's dtype; state's slots
    of the batch are overwritten with each sequence's final state.

    Raises:
        KernelArgumentError: a tensor of the wrong shape, dtype or device, or a bad dt_limit.
    """
    _check_scan(x, dt, A, B, C, D, dt_bias, state, query_start, slots, has_state, dt_limit)
    if not _compiled(x):
        return selective_scan_torch(x, dt, A, B, C, D, dt_bias, state, query_start, slots, has_state, dt_limit)
    return torch.ops.pagefleet.selective_scan_state(
        x, dt, A, B, C, D, dt_bias, state, query_start, slots, has_state, list(dt_limit)
    )
