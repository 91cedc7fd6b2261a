"""Routed experts on GPUs: every token through its top-k experts' gated MLPs as two grouped
matmuls over the (token, slot) pairs sorted by expert, like vLLM's fused_moe.

    hidden [T, H], weights [T, k], experts [T, k] (each token's experts and their weights)
    gate_up [E*2I, H]  (per expert: its I gate rows, then its I up rows)   down [E*H, I]
    gate_up_bias [E*2I], down_bias [E*H] (gpt-oss), or neither
    out[t] = sum over t's experts e, ascending: weight * (down_e(act(gate_e(x), up_e(x))) + b)

An expert id below 0 means "held by another tensor-parallel rank" (expert parallelism): its
pair is computed by no path here and adds nothing, so a token whose experts are all
elsewhere gets zeros.

`moe_align` (torch) sorts the pairs by expert and pads each expert's run to a multiple of
`block_m`, so that a block of rows belongs to one expert:

    sorted_pairs  | e0 e0 e0 -- | e2 e2 e2 e2 | e2 -- -- -- | e5 -- -- -- | x  x  -- -- |  (--: padding)
    block_experts |     0       |      2      |      2      |      5      |     -1      |  -1 ...

(x: pairs of experts on another rank, after every expert's run, in blocks no kernel computes.)

`_gate_up_kernel`, one program per (block, tile of I columns), computes the block's gate
and up tiles side by side and writes the activation; `_down_kernel`, per (block, tile of H
columns), the down projection, bias and routing weight: one contribution row per pair.
Torch then sums a token's k contributions in ascending expert order, in the output dtype.
Rounding follows the reference op by op (a float32 matmul rounded to the dtype, each bias
add and activation step rounded as its torch op is).

`fused_experts_torch` is the reference (and the engine's plain-torch path): expert by
expert over its tokens, `index_add_` of the weighted rows. The CPU operator
(csrc/cpu_experts.cpp) takes the activation as its index in ACTIVATIONS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagefleet.kernels.checks import FLOAT_DTYPES, INDEX_DTYPES, KernelArgumentError, check_shape, check_tensor

# An activation's index here is its code in the kernels (csrc/cpu_experts.cpp too).
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


def activation_torch(gate: torch.Tensor, up: torch.Tensor, kind: str, alpha: float, limit: float) -> torch.Tensor:
    """`act(gate) * up` with act "silu" or "gelu_tanh", or gpt-oss's "swiglu_oai": gate clamped
    above at `limit`, up to [-limit, limit], then `(up + 1) * gate * sigmoid(alpha * gate)`."""
    if kind == "silu":
        return F.silu(gate) * up
    if kind == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if kind == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    raise ValueError(f"unknown expert activation {kind!r}")


def fused_experts_torch(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The reference: expert by expert in ascending order, each over its tokens (as
    transformers runs them), so a token's contributions are added in ascending expert order."""
    width = down.shape[1]
    num_experts = down.shape[0] // hidden.shape[1]
    gate_up_stack = gate_up.view(num_experts, 2 * width, -1)
    down_stack = down.view(num_experts, -1, width)
    out = torch.zeros_like(hidden)
    for expert in experts.unique().tolist():
        if expert < 0:  # on another rank
            continue
        tokens, slots = torch.where(experts == expert)
        projected = F.linear(hidden[tokens], gate_up_stack[expert])
        if gate_up_bias is not None:
            projected = projected + gate_up_bias.view(num_experts, -1)[expert]
        gate, up = projected.chunk(2, dim=-1)
        routed = F.linear(activation_torch(gate, up, activation, alpha, limit), down_stack[expert])
        if down_bias is not None:
            routed = routed + down_bias.view(num_experts, -1)[expert]
        out.index_add_(0, tokens, (routed * weights[tokens, slots, None]).to(out.dtype))
    return out


def moe_align(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts): pairs (token * k + slot) by expert, token order within
    one, each expert's run padded to a multiple of `block_m` with the pair count T*k; and
    each block's expert (-1 past the last). Pairs of negative experts (another rank's) come
    last, as one more run whose blocks are -1. Sized for the worst case, so no host sync."""
    flat = experts.flatten()
    num_pairs = flat.numel()
    buckets = flat.masked_fill(flat < 0, num_experts)  # bucket num_experts: another rank's pairs
    order = torch.argsort(buckets, stable=True)
    counts = torch.bincount(buckets, minlength=num_experts + 1)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    firsts = torch.cumsum(counts, 0) - counts
    by_bucket = buckets[order]
    positions = (
        padded_ends[by_bucket] - padded[by_bucket] + torch.arange(num_pairs, device=flat.device) - firsts[by_bucket]
    )
    capacity = num_pairs + (num_experts + 1) * (block_m - 1)
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[positions] = order
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_pairs, block_experts


@triton.jit
def _round(x, dtype: tl.constexpr):
    """x as a `dtype` holds it, back in float32: the rounding of a torch op's output. bfloat16
    by its bits, to nearest even as torch rounds (the interpreter's cast truncates)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        result = bits.to(tl.float32, bitcast=True)
    else:
        result = x.to(dtype).to(tl.float32)
    return result


@triton.jit
def _activate(gate, up, alpha, limit, dtype: tl.constexpr, ACTIVATION: tl.constexpr):
    if ACTIVATION == 2:  # swiglu_oai
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        sigmoid = _round(1.0 / (1.0 + tl.exp(-_round(gate * alpha, dtype))), dtype)
        result = _round(_round(up + 1.0, dtype) * _round(gate * sigmoid, dtype), dtype)
    else:  # silu: g / (1 + exp(-g)); gelu_tanh: the same with 2 sqrt(2/pi) (g + 0.044715 g^3)
        exponent = gate
        if ACTIVATION == 1:
            exponent = 1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)
        result = _round(_round(gate / (1.0 + tl.exp(-exponent)), dtype) * up, dtype)
    return result


@triton.jit
def _gate_up_kernel(
    hidden_ptr,
    gate_up_ptr,
    gate_up_bias_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    activated_ptr,
    num_pairs,
    top_k,
    hidden_size,
    width,
    stride_ht,
    alpha,
    limit,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = pairs < num_pairs
        tokens = pairs // top_k
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        column_ok = columns < width
        gate_rows = expert * 2 * width + columns  # the up rows follow, `width` further
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, hidden_size, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden_size
            x_mask = valid[:, None] & k_ok[None, :]
            x = tl.load(hidden_ptr + tokens[:, None] * stride_ht + ks[None, :], mask=x_mask, other=0.0).to(tl.float32)
            w_mask = k_ok[:, None] & column_ok[None, :]
            w_gate = tl.load(gate_up_ptr + gate_rows[None, :] * hidden_size + ks[:, None], mask=w_mask, other=0.0).to(
                tl.float32
            )
            w_up = tl.load(
                gate_up_ptr + (gate_rows + width)[None, :] * hidden_size + ks[:, None], mask=w_mask, other=0.0
            ).to(tl.float32)
            acc_gate = tl.dot(x, w_gate, acc_gate, input_precision="ieee")
            acc_up = tl.dot(x, w_up, acc_up, input_precision="ieee")
        dtype = activated_ptr.dtype.element_ty
        gate = _round(acc_gate, dtype)
        up = _round(acc_up, dtype)
        if HAS_BIAS:
            gate_bias = tl.load(gate_up_bias_ptr + gate_rows, mask=column_ok, other=0.0).to(tl.float32)
            up_bias = tl.load(gate_up_bias_ptr + gate_rows + width, mask=column_ok, other=0.0).to(tl.float32)
            gate = _round(gate + gate_bias[None, :], dtype)
            up = _round(up + up_bias[None, :], dtype)
        activated = _activate(gate, up, alpha, limit, dtype, ACTIVATION)
        out_mask = valid[:, None] & column_ok[None, :]
        tl.store(activated_ptr + pairs[:, None] * width + columns[None, :], activated.to(dtype), mask=out_mask)


@triton.jit
def _down_kernel(
    activated_ptr,
    down_ptr,
    down_bias_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    contributions_ptr,
    num_pairs,
    hidden_size,
    width,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        valid = pairs < num_pairs
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        column_ok = columns < hidden_size
        rows = expert * hidden_size + columns
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, width, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < width
            a = tl.load(
                activated_ptr + pairs[:, None] * width + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
            ).to(tl.float32)
            w = tl.load(
                down_ptr + rows[None, :] * width + ks[:, None], mask=k_ok[:, None] & column_ok[None, :], other=0.0
            ).to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision="ieee")
        dtype = contributions_ptr.dtype.element_ty
        routed = _round(acc, dtype)
        if HAS_BIAS:
            routed = _round(
                routed + tl.load(down_bias_ptr + rows, mask=column_ok, other=0.0).to(tl.float32)[None, :], dtype
            )
        weight = tl.load(weights_ptr + pairs, mask=valid, other=0.0)
        out_mask = valid[:, None] & column_ok[None, :]
        tl.store(
            contributions_ptr + pairs[:, None] * hidden_size + columns[None, :],
            (routed * weight[:, None]).to(dtype),
            mask=out_mask,
        )


def _check(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
) -> int:
    """The number of experts, once every tensor is checked against the layout above."""
    check_tensor("hidden", hidden, 2, FLOAT_DTYPES)
    check_tensor("weights", weights, 2, FLOAT_DTYPES, hidden.device)
    check_tensor("experts", experts, 2, INDEX_DTYPES, hidden.device)
    check_shape("weights", weights, (hidden.shape[0], weights.shape[1]))
    check_shape("experts", experts, tuple(weights.shape))
    check_tensor("down", down, 2, (hidden.dtype,), hidden.device)
    num_experts, remainder = divmod(down.shape[0], hidden.shape[1])
    if remainder or not down.is_contiguous():
        raise KernelArgumentError(f"down: expected contiguous [E*{hidden.shape[1]}, I], got {tuple(down.shape)}")
    check_tensor("gate_up", gate_up, 2, (hidden.dtype,), hidden.device)
    check_shape("gate_up", gate_up, (num_experts * 2 * down.shape[1], hidden.shape[1]))
    if not gate_up.is_contiguous():
        raise KernelArgumentError("gate_up: must be contiguous")
    if (gate_up_bias is None) != (down_bias is None):
        raise KernelArgumentError("gate_up_bias and down_bias: give both or neither")
    if gate_up_bias is not None and down_bias is not None:
        check_tensor("gate_up_bias", gate_up_bias, 1, (hidden.dtype,), hidden.device)
        check_shape("gate_up_bias", gate_up_bias, (gate_up.shape[0],))
        check_tensor("down_bias", down_bias, 1, (hidden.dtype,), hidden.device)
        check_shape("down_bias", down_bias, (down.shape[0],))
    return num_experts


def fused_experts(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """[T, H]: the module docstring's sum, for the tensors laid out as it says.

    Raises:
        KernelArgumentError: a tensor of the wrong shape, dtype, device or layout, or an
            activation not in ACTIVATIONS.
    """
    num_experts = _check(hidden, weights, experts, gate_up, down, gate_up_bias, down_bias)
    if activation not in ACTIVATIONS:
        raise KernelArgumentError(f"activation: {activation!r} is not one of {ACTIVATIONS}")
    (num_tokens, hidden_size), top_k, width = hidden.shape, experts.shape[1], down.shape[1]
    out = torch.zeros_like(hidden)
    if num_tokens == 0 or top_k == 0:
        return out
    sorted_pairs, block_experts = moe_align(experts.long(), num_experts, block_m)
    activated = torch.empty(num_tokens * top_k, width, dtype=hidden.dtype, device=hidden.device)
    contributions = torch.empty(num_tokens * top_k, hidden_size, dtype=hidden.dtype, device=hidden.device)
    has_bias = gate_up_bias is not None
    _gate_up_kernel[(block_experts.numel(), triton.cdiv(width, block_n))](
        hidden,
        gate_up,
        gate_up_bias if gate_up_bias is not None else gate_up,
        sorted_pairs,
        block_experts,
        activated,
        num_tokens * top_k,
        top_k,
        hidden_size,
        width,
        hidden.stride(0),
        alpha,
        limit,
        HAS_BIAS=has_bias,
        ACTIVATION=ACTIVATIONS.index(activation),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    _down_kernel[(block_experts.numel(), triton.cdiv(hidden_size, block_n))](
        activated,
        down,
        down_bias if down_bias is not None else down,
        weights.float().contiguous(),
        sorted_pairs,
        block_experts,
        contributions,
        num_tokens * top_k,
        hidden_size,
        width,
        HAS_BIAS=has_bias,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return _add_in_expert_order(contributions.view(num_tokens, top_k, hidden_size), experts, out)


def _add_in_expert_order(contributions: torch.Tensor, experts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[t] += contributions[t, s] for t's slots s by ascending expert, each add in out's
    dtype, as the reference's index_add_ of one expert after another. The slots of negative
    experts were never written: zeroed here (in place: the launcher's scratch), they sort
    first and 0 + 0 leaves out's 0."""
    contributions.masked_fill_(experts[:, :, None] < 0, 0.0)
    order = torch.argsort(experts, dim=1, stable=True)
    ordered = torch.take_along_dim(contributions, order[:, :, None], dim=1)
    for slot in range(ordered.shape[1]):
        out += ordered[:, slot]
    return out
