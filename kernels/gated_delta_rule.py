"""The gated delta rule of Qwen3-Next's linear-attention layers (Gated DeltaNet), in its
recurrent form, over a flat batch of sequences each with its own state slot.

    query, key [T, Hk, Dk]   value [T, Hv, Dv] (key head h // (Hv / Hk) serves value head h)
    g [T, Hv] float32 (log decay, <= 0)   beta [T, Hv]   state [S, Hv, Dk, Dv] float32
    sequence i: rows query_start[i] : query_start[i+1], state slot slots[i], and has_state[i]
                (True: start from the slot's state; False: from zeros, a prompt's first chunk)

As transformers' `torch_recurrent_gated_delta_rule` computes it, in float32: q and k
l2-normalised (eps 1e-6) when use_qk_l2norm, q divided by sqrt(Dk); then per row t, for
each value head's state S [Dk, Dv]:

    S     = S * exp(g_t)
    delta = (v_t - sum_k S * k_t) * beta_t      (what S already predicts for k_t is removed)
    S     = S + k_t delta^T
    o_t   = sum_k S * q_t

Why recurrent, not chunked: a row's output and the final state are a fixed sequence of
per-row operations, so they are bit-identical whether a sequence's rows arrive in one call or
split across calls at any row (the state carried in its slot), and whatever sequences share
the batch. The chunked form's results depend on where chunks start. The slot is overwritten
with the state after the sequence's last row.

`gated_delta_rule_torch` is the reference and the CPU path: transformers' ops in its order
(so in float32 a sequence equals its function's result bit for bit), vectorised over the
heads of every sequence that still has rows, in a Python loop over row positions.
`gated_delta_rule` is the Triton kernel: one program per (sequence, value head, tile of Dv
columns) keeps its [Dk, tile] slice of the state in registers over the sequence's rows. Its
sums are not torch's, so it agrees with the reference to float32 rounding; its split and
batch invariance hold bit for bit (a program's operations do not depend on either).

Preconditions no check can see without a device sync: the slots of one call are distinct
and within [0, S), and query_start is non-decreasing with query_start[N] <= T. Rows past
query_start[N] get zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.kernels.causal_conv1d import check_sequences
from pagefleet.kernels.checks import FLOAT_DTYPES, KernelArgumentError, check_shape, check_tensor
from pagefleet.kernels.state_rows import recur_by_rows

L2NORM_EPS = 1e-6  # transformers' l2norm, as the FLA library's kernels


def _check(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
) -> None:
    check_tensor("query", query, 3, FLOAT_DTYPES)
    num_tokens, num_key_heads, key_dim = query.shape
    device = query.device
    check_tensor("key", key, 3, (query.dtype,), device)
    check_shape("key", key, tuple(query.shape))
    check_tensor("value", value, 3, FLOAT_DTYPES, device)
    num_heads, value_dim = value.shape[1], value.shape[2]
    check_shape("value", value, (num_tokens, num_heads, value_dim))
    if num_key_heads == 0 or num_heads % num_key_heads:
        raise KernelArgumentError(f"value: {num_heads} heads is not a multiple of key's {num_key_heads}")
    check_tensor("g", g, 2, (torch.float32,), device)
    check_shape("g", g, (num_tokens, num_heads))
    check_tensor("beta", beta, 2, FLOAT_DTYPES, device)
    check_shape("beta", beta, (num_tokens, num_heads))
    check_tensor("state", state, 4, (torch.float32,), device)
    check_shape("state", state, (state.shape[0], num_heads, key_dim, value_dim))
    check_sequences(query_start, slots, has_state, device)


@triton.jit
def _row_step(recurrent, row, pointers, strides, dim_ok, column_ok, query_scale, eps, L2NORM: tl.constexpr):
    """One row of the recurrence (both kernels': chunked_gated_delta_rule.py's rows outside
    chunks are these ops); writes the row's output and returns the state [BLOCK_K, BLOCK_V].
    `pointers` are row 0's q, k, v, g, beta and out of this program's head, `strides` their
    row strides."""
    q_at, k_at, v_at, g_at, beta_at, out_at = pointers
    stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, stride_ot = strides
    q = tl.load(q_at + row * stride_qt, mask=dim_ok, other=0.0).to(tl.float32)
    k = tl.load(k_at + row * stride_kt, mask=dim_ok, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + eps)
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + eps)
    q = q / query_scale
    v = tl.load(v_at + row * stride_vt, mask=column_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_at + row * stride_bt).to(tl.float32)
    recurrent = recurrent * tl.exp(tl.load(g_at + row * stride_gt))
    delta = (v - tl.sum(recurrent * k[:, None], axis=0)) * beta
    recurrent = recurrent + k[:, None] * delta[None, :]
    out = tl.sum(recurrent * q[:, None], axis=0)
    tl.store(out_at + row * stride_ot, out.to(out_at.dtype.element_ty), mask=column_ok)
    return recurrent


@triton.jit
def _program_tile(tensors, row_strides, other_strides, sizes, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """What a program (sequence, value head, tile of Dv) of a delta-rule kernel works on,
    from the kernel's arguments: tensors (query, key, value, g, beta, state, slots,
    has_state, out), row_strides (q's, k's, v's, g's, beta's), other_strides (q's, k's and
    v's per head, state's per slot, head and key row) and sizes (heads, heads per key head,
    Dk, Dv). Returns (row 0's pointers and their row strides, as `_row_step` takes them; Dk's
    and Dv's masks; the state tile's address and mask; the state tile, its slot's or zeros
    without has_state)."""
    query_ptr, key_ptr, value_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, has_state_ptr, out_ptr = tensors
    stride_qt, stride_kt, stride_vt, stride_gt, stride_bt = row_strides
    stride_qh, stride_kh, stride_vh, stride_ss, stride_sh, stride_sk = other_strides
    num_heads, heads_per_key, key_dim, value_dim = sizes
    sequence, head = tl.program_id(0), tl.program_id(1)
    key_head = head // heads_per_key
    dims = tl.arange(0, BLOCK_K)
    dim_ok = dims < key_dim
    columns = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    column_ok = columns < value_dim
    # Row 0's q, k, v, g, beta and out of this head; row t's is at + t * its row stride.
    pointers = (
        query_ptr + key_head * stride_qh + dims,
        key_ptr + key_head * stride_kh + dims,
        value_ptr + head * stride_vh + columns,
        g_ptr + head,
        beta_ptr + head,
        out_ptr + head * value_dim + columns,
    )
    strides = (stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, num_heads * value_dim)
    slot = tl.load(slots_ptr + sequence).to(tl.int64)
    state_at = state_ptr + slot * stride_ss + head * stride_sh + dims[:, None] * stride_sk + columns[None, :]
    tile_mask = dim_ok[:, None] & column_ok[None, :]
    # Padding rows and columns of the state stay 0: their k, q and v are loaded as 0.
    recurrent = tl.load(state_at, mask=tile_mask & tl.load(has_state_ptr + sequence), other=0.0)
    return pointers, strides, dim_ok, column_ok, state_at, tile_mask, recurrent


@triton.jit
def _gated_delta_rule_kernel(
    query_ptr,
    key_ptr,
    value_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    query_start_ptr,
    slots_ptr,
    has_state_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ss,
    stride_sh,
    stride_sk,
    num_heads,
    heads_per_key,
    key_dim,
    value_dim,
    query_scale,  # sqrt(Dk): q is divided by it, as transformers does
    eps,
    L2NORM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    tile = _program_tile(
        (query_ptr, key_ptr, value_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, has_state_ptr, out_ptr),
        (stride_qt, stride_kt, stride_vt, stride_gt, stride_bt),
        (stride_qh, stride_kh, stride_vh, stride_ss, stride_sh, stride_sk),
        (num_heads, heads_per_key, key_dim, value_dim),
        BLOCK_K,
        BLOCK_V,
    )
    pointers, strides, dim_ok, column_ok, state_at, tile_mask, recurrent = tile
    sequence = tl.program_id(0)
    start = tl.load(query_start_ptr + sequence).to(tl.int64)
    end = tl.load(query_start_ptr + sequence + 1).to(tl.int64)
    for row in range(start, end):
        recurrent = _row_step(recurrent, row, pointers, strides, dim_ok, column_ok, query_scale, eps, L2NORM)
    tl.store(state_at, recurrent, mask=tile_mask)


def gated_delta_rule(
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
    block_v: int = 64,
) -> torch.Tensor:
    """out [T, Hv, Dv] in value's dtype: the module docstring's recurrence; state's slots of the
    batch are overwritten in place with each sequence's final state, the other slots untouched.

    Args:
        query, key: [T, Hk, Dk], one dtype; value: [T, Hv, Dv], Hv a multiple of Hk.
        g: [T, Hv] float32 log decays (<= 0); beta: [T, Hv], any float dtype.
        state: [S, Hv, Dk, Dv] float32, any strides with a contiguous Dv.
        query_start: [N + 1]; slots: [N]; has_state: [N] bool (see the module docstring).
        use_qk_l2norm: l2-normalise q and k first (Qwen3-Next does).
        block_v: Dv columns per program (a power of 2).

    Raises:
        KernelArgumentError: a tensor of the wrong shape, dtype or device.
    """
    _check(query, key, value, g, beta, state, query_start, slots, has_state)
    num_tokens, num_key_heads, key_dim = query.shape
    num_heads, value_dim = value.shape[1], value.shape[2]
    out = torch.zeros(num_tokens, num_heads, value_dim, dtype=value.dtype, device=value.device)
    if slots.shape[0] == 0 or num_heads == 0 or value_dim == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(value_dim))
    _gated_delta_rule_kernel[(slots.shape[0], num_heads, triton.cdiv(value_dim, block_v))](
        query,
        key,
        value,
        g,
        beta,
        state,
        query_start,
        slots,
        has_state,
        out,
        *query.stride()[:2],
        *key.stride()[:2],
        *value.stride()[:2],
        g.stride(0),
        beta.stride(0),
        *state.stride()[:3],
        num_heads,
        num_heads // num_key_heads,
        key_dim,
        value_dim,
        key_dim**0.5,
        L2NORM_EPS,
        L2NORM=use_qk_l2norm,
        BLOCK_K=triton.next_power_of_2(key_dim),
        BLOCK_V=block_v,
    )
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' l2norm over the last dimension, op for op."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _recurrent_step(
    recurrent: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row of n sequences, all float32: recurrent [n, Hv, Dk, Dv]; query, key [n, Hv, Dk];
    value [n, Hv, Dv]; g, beta [n, Hv]. Returns (the new state, the output [n, Hv, Dv]), by
    transformers' ops in its order (a reduction over Dk gives the same bits for any n)."""
    recurrent = recurrent * g.exp()[..., None, None]
    kv_mem = (recurrent * key.unsqueeze(-1)).sum(dim=-2)
    delta = (value - kv_mem) * beta.unsqueeze(-1)
    recurrent = recurrent + key.unsqueeze(-1) * delta.unsqueeze(-2)
    return recurrent, (recurrent * query.unsqueeze(-1)).sum(dim=-2)


def gated_delta_rule_torch(
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
    """The reference, and the CPU path: same arguments and result as `gated_delta_rule`.

    Token by token over the batch's sequences, their states [n, Hv, Dk, Dv] (kernels/state_rows.py)."""
    _check(query, key, value, g, beta, state, query_start, slots, has_state)
    heads_per_key = value.shape[1] // query.shape[1]
    query, key = query.float(), key.float()
    if use_qk_l2norm:  # per vector, so before repeat_interleave gives the same bits
        query, key = _l2norm(query), _l2norm(key)
    query = (query / (query.shape[-1] ** 0.5)).repeat_interleave(heads_per_key, dim=1)
    key = key.repeat_interleave(heads_per_key, dim=1)
    value_float, beta = value.float(), beta.float()
    out = torch.zeros(value.shape, dtype=torch.float32, device=value.device)

    def step(recurrent: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        recurrent, out[rows] = _recurrent_step(
            recurrent, query[rows], key[rows], value_float[rows], g[rows], beta[rows]
        )
        return recurrent

    recur_by_rows(state, query_start, slots, has_state, step)
    return out.to(value.dtype)
