"""Mamba-2's selective state-space scan (IBM Granite 4's hybrid layers), in its recurrent
form, over a flat batch of sequences each with its own state slot.

    x [T, H, P] (P = head dim)   dt [T, H] (raw: before dt_bias and softplus)   A [H] float32
    B, C [T, G, N] (head h reads group h // (H / G), as repeat_interleave)   D, dt_bias [H]
    state [S, H, P, N] float32
    sequence i: rows query_start[i] : query_start[i+1], state slot slots[i], and has_state[i]
                (True: start from the slot's state; False: from zeros, a prompt's first chunk)

As transformers' decode step `mamba2_selective_state_update` computes it, per row t and
head h, with the state S [P, N] of h:

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)     in x's dtype
    S    = S * exp(dt_t * A) + (dt_t * B_t) * x_t           float32 (dt_t * B_t and the
                                                            product with x_t in x's dtype)
    y_t  = S @ C_t + D * x_t                                S rounded to x's dtype first; the
                                                            sum over N in float32, as bmm
Its chunked path clamps dt, its step does not; with the default limits the clamp is a no-op.

Why recurrent, not chunked: a row's output and the final state are a fixed sequence of
per-row operations, so they are bit-identical whether a sequence's rows arrive in one call or
split across calls at any row (the state carried in its slot), and whatever sequences share
the batch. The slot is overwritten with the state after the sequence's last row.

`selective_scan_torch` is the reference and the CPU path: transformers' step's ops and
casts in its order, vectorised over the heads of every sequence that still has rows, in a
Python loop over row positions (the elementwise ops on dt, B and C once over all rows). A
row equals transformers' step bit for bit, in float32 and in bfloat16. One op needs care:
torch's float32 CPU softplus rounds ~12% of elements an ulp apart in its vectorised loop and
its scalar tail, and which elements fall in the tail depends on the tensor's length.
Transformers' step softplus-es B * H * P elements, a multiple of the vector width in Granite
(P = 64), so all take the vector loop; the reference pads dt so that all do at any batch size
(else a sequence's bits would depend on its company). torch.bmm computes each head's
[P, N] @ [N] alone (checked for P 8 and 64, N 16 and 128, float32 and bfloat16, AVX2).
In bfloat16, transformers' prefill (its chunked path, in float32) rounds otherwise: the
reference follows its step, the only one of its two that a split cannot change.

`selective_scan` is the Triton kernel: one program per (sequence, head, tile of P rows of
the state) keeps its [tile, N] slice in registers over the sequence's rows, and rounds to
x's dtype where the reference does (by the bits for bfloat16: the interpreter's cast
truncates). Its exp, softplus and sum over N are not torch's, so it agrees with the
reference to float32 rounding (in bfloat16, the same roundings of nearly the same values);
its split and batch invariance hold bit for bit (a program's operations depend on neither).

Preconditions no check can see without a device sync: the slots of one call are distinct
and within [0, S), and query_start is non-decreasing with query_start[N] <= T. Rows outside
every sequence get zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagefleet.kernels.causal_conv1d import check_sequences
from pagefleet.kernels.checks import FLOAT_DTYPES, KernelArgumentError, check_shape, check_tensor
from pagefleet.kernels.state_rows import recur_by_rows

NO_LIMIT = (0.0, float("inf"))  # transformers' default time_step_limit
SOFTPLUS_THRESHOLD = 20.0  # F.softplus's default: above it, softplus(x) is x
SOFTPLUS_RUN = 64  # twice the widest vector torch's CPU kernels use (AVX-512, bfloat16)
SOFTPLUS_CALL = 16384  # elements per call, below TensorIterator's grain: one thread, one run


def _check(
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
    dt_limit: tuple[float, float],
) -> None:
    check_tensor("x", x, 3, FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = x.shape
    device = x.device
    check_tensor("dt", dt, 2, (x.dtype,), device)
    check_shape("dt", dt, (num_tokens, num_heads))
    check_tensor("A", A, 1, (torch.float32,), device)
    check_shape("A", A, (num_heads,))
    check_tensor("B", B, 3, (x.dtype,), device)
    num_groups, state_size = B.shape[1], B.shape[2]
    check_shape("B", B, (num_tokens, num_groups, state_size))
    if num_groups == 0 or num_heads % num_groups:
        raise KernelArgumentError(f"B: {num_groups} groups do not divide x's {num_heads} heads")
    check_tensor("C", C, 3, (x.dtype,), device)
    check_shape("C", C, tuple(B.shape))
    for name, tensor in (("D", D), ("dt_bias", dt_bias)):
        check_tensor(name, tensor, 1, FLOAT_DTYPES, device)
        check_shape(name, tensor, (num_heads,))
    check_tensor("state", state, 4, (torch.float32,), device)
    check_shape("state", state, (state.shape[0], num_heads, head_dim, state_size))
    check_sequences(query_start, slots, has_state, device)
    if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
        raise KernelArgumentError(f"dt_limit: expected (low, high) with low <= high, got {dt_limit}")


@triton.jit
def _round(value, DTYPE: tl.constexpr):
    """value (float32) rounded to DTYPE, to nearest with ties to even, as a float32. A
    bfloat16 is rounded by its bits: the interpreter truncates a cast to bfloat16."""
    if DTYPE == tl.bfloat16:
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return value.to(DTYPE).to(tl.float32)


@triton.jit
def _head_params(A_ptr, D_ptr, dt_bias_ptr, head, dt_low, dt_high, threshold, ROUND: tl.constexpr, DTYPE: tl.constexpr):
    """(A, D, dt_bias, dt_low, dt_high, threshold) of a head in float32, dt_bias rounded to
    x's dtype (torch adds it to dt in dt's dtype)."""
    bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    if ROUND:  # around each call: a nested @triton.jit call costs the interpreter ~1 ms
        bias = _round(bias, DTYPE)
    return tl.load(A_ptr + head), tl.load(D_ptr + head).to(tl.float32), bias, dt_low, dt_high, threshold


@triton.jit
def _dt(raw, bias, dt_low, dt_high, threshold, ROUND: tl.constexpr, DTYPE: tl.constexpr):
    """clamp(softplus(raw + bias)) of a row's dt (or a chunk's, chunked_selective_scan.py),
    float32 in and out, rounded to DTYPE where torch rounds it."""
    dt = raw + bias
    if ROUND:
        dt = _round(dt, DTYPE)
    # softplus = log1p(exp(dt)) below the threshold; log1p(u) as log(w) corrected by
    # w = 1 + u's rounding error, where log(w) alone would lose u's low bits (dt ~ -7).
    u = tl.exp(tl.minimum(dt, threshold))
    w = 1.0 + u
    softplus = tl.log(w) - ((w - 1.0) - u) / w
    dt = tl.where(dt > threshold, dt, softplus)
    if ROUND:
        dt = _round(dt, DTYPE)
    return tl.minimum(tl.maximum(dt, dt_low), dt_high)


@triton.jit
def _row_step(recurrent, row, pointers, strides, dim_ok, n_ok, params, ROUND: tl.constexpr, SKIP_IN_X: tl.constexpr):
    """One row of the module docstring's recurrence for a head and a tile of P: writes the
    row's output and returns the state [BLOCK_P, BLOCK_N]. pointers: row 0's (x, dt, B, C,
    out) of the head and tile, strides their row strides; params: `_head_params`'s."""
    x_at, dt_at, b_at, c_at, out_at = pointers
    stride_xt, stride_dt, stride_bt, stride_ct, stride_ot = strides
    A, D, bias, dt_low, dt_high, threshold = params
    dtype = out_at.dtype.element_ty
    dt = _dt(tl.load(dt_at + row * stride_dt).to(tl.float32), bias, dt_low, dt_high, threshold, ROUND, dtype)
    x = tl.load(x_at + row * stride_xt, mask=dim_ok, other=0.0).to(tl.float32)
    db = dt * tl.load(b_at + row * stride_bt, mask=n_ok, other=0.0).to(tl.float32)
    if ROUND:
        db = _round(db, dtype)
    dbx = db[None, :] * x[:, None]
    if ROUND:
        dbx = _round(dbx, dtype)
    recurrent = recurrent * tl.exp(dt * A) + dbx
    readout = recurrent
    if ROUND:
        readout = _round(readout, dtype)
    y = tl.sum(readout * tl.load(c_at + row * stride_ct, mask=n_ok, other=0.0).to(tl.float32)[None, :], axis=1)
    skip = x * D
    if ROUND:
        y = _round(y, dtype)
        if SKIP_IN_X:
            skip = _round(skip, dtype)
        y = _round(y + skip, dtype)  # so the store's cast is exact
    else:
        y = y + skip
    tl.store(out_at + row * stride_ot, y.to(dtype), mask=dim_ok)
    return recurrent


@triton.jit
def _program_tile(
    tensors, row_strides, other_strides, scalars, ROUND: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):
    """What a program (sequence, head, tile of P) of a scan kernel works on, from the kernel's
    arguments: tensors (x, dt, A, B, C, D, dt_bias, state, slots, has_state, out), row_strides
    (x's, dt's, B's and C's), other_strides (x's per head, B's and C's per group, state's per
    slot, head and row of P) and scalars (heads, heads per group, P, N, dt_low, dt_high,
    threshold). Returns (row 0's pointers and their row strides, as `_row_step` takes them;
    P's and N's masks; `_head_params`; the state tile's address and mask; the state tile, its
    slot's or zeros without has_state)."""
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, slots_ptr, has_state_ptr, out_ptr = tensors
    stride_xt, stride_dt, stride_bt, stride_ct = row_strides
    stride_xh, stride_bg, stride_cg, stride_ss, stride_sh, stride_sp = other_strides
    num_heads, heads_per_group, head_dim, state_size, dt_low, dt_high, threshold = scalars
    sequence, head = tl.program_id(0), tl.program_id(1)
    dims, ns = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_N)
    dim_ok, n_ok = dims < head_dim, ns < state_size
    group = head // heads_per_group
    # Row 0's x, dt, B, C and out of this head and tile; row t's is at + t * its row stride.
    x_at, out_at = x_ptr + head * stride_xh + dims, out_ptr + head * head_dim + dims
    pointers = (x_at, dt_ptr + head, B_ptr + group * stride_bg + ns, C_ptr + group * stride_cg + ns, out_at)
    strides = (stride_xt, stride_dt, stride_bt, stride_ct, num_heads * head_dim)
    params = _head_params(A_ptr, D_ptr, dt_bias_ptr, head, dt_low, dt_high, threshold, ROUND, x_ptr.dtype.element_ty)
    slot = tl.load(slots_ptr + sequence).to(tl.int64)
    state_at = state_ptr + slot * stride_ss + head * stride_sh + dims[:, None] * stride_sp + ns[None, :]
    tile_mask = dim_ok[:, None] & n_ok[None, :]
    # Padding rows and columns of the state stay 0: their x, B and C are loaded as 0.
    recurrent = tl.load(state_at, mask=tile_mask & tl.load(has_state_ptr + sequence), other=0.0)
    return pointers, strides, dim_ok, n_ok, params, state_at, tile_mask, recurrent


@triton.jit
def _selective_scan_kernel(
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    dt_bias_ptr,
    state_ptr,
    query_start_ptr,
    slots_ptr,
    has_state_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_dt,
    stride_bt,
    stride_bg,
    stride_ct,
    stride_cg,
    stride_ss,
    stride_sh,
    stride_sp,
    num_heads,
    heads_per_group,
    head_dim,
    state_size,
    dt_low,  # dt_limit, already rounded to dt's dtype (as torch.clamp rounds its bounds)
    dt_high,
    threshold,
    ROUND: tl.constexpr,  # x's dtype is narrower than float32: round to it where torch does
    SKIP_IN_X_DTYPE: tl.constexpr,  # and round D * x to it (torch's promotion of x and D)
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tensors = (x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, slots_ptr, has_state_ptr, out_ptr)
    row_strides = (stride_xt, stride_dt, stride_bt, stride_ct)
    other_strides = (stride_xh, stride_bg, stride_cg, stride_ss, stride_sh, stride_sp)
    scalars = (num_heads, heads_per_group, head_dim, state_size, dt_low, dt_high, threshold)
    tile = _program_tile(tensors, row_strides, other_strides, scalars, ROUND, BLOCK_P, BLOCK_N)
    pointers, strides, dim_ok, n_ok, params, state_at, tile_mask, recurrent = tile
    sequence = tl.program_id(0)
    start = tl.load(query_start_ptr + sequence).to(tl.int64)
    end = tl.load(query_start_ptr + sequence + 1).to(tl.int64)
    for row in range(start, end):
        recurrent = _row_step(recurrent, row, pointers, strides, dim_ok, n_ok, params, ROUND, SKIP_IN_X_DTYPE)
    tl.store(state_at, recurrent, mask=tile_mask)


def _scalar_arguments(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    dt_limit: tuple[float, float],
) -> tuple[int | float, ...]:
    """A scan kernel's arguments from stride_xt to threshold, in its order (this module's and
    chunked_selective_scan.py's): the strides, the sizes, dt_limit rounded to dt's dtype (as
    torch.clamp rounds its bounds) and softplus's threshold."""
    num_heads = x.shape[1]
    dt_low, dt_high = torch.tensor(dt_limit, dtype=dt.dtype).tolist()
    strides = (*x.stride()[:2], dt.stride(0), *B.stride()[:2], *C.stride()[:2], *state.stride()[:3])
    return (*strides, num_heads, num_heads // B.shape[1], x.shape[2], B.shape[2], dt_low, dt_high, SOFTPLUS_THRESHOLD)


def selective_scan(
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
    block_p: int = 16,
) -> torch.Tensor:
    """y [T, H, P] in x's dtype: the module docstring's recurrence; state's slots of the batch
    are overwritten in place with each sequence's final state, the other slots untouched.

    Args:
        x: [T, H, P]; dt: [T, H], the raw projection; B, C: [T, G, N], G dividing H. All four
            in one dtype, with a contiguous last dimension (rows may be strided views).
        A: [H] float32, -exp(A_log); D, dt_bias: [H], any float dtype.
        state: [S, H, P, N] float32, any strides with a contiguous N.
        query_start: [N + 1]; slots: [N]; has_state: [N] bool (see the module docstring).
        dt_limit: (low, high) bounds of dt after softplus (the model's time_step_limit).
        block_p: state rows (of P) per program, a power of 2: a [block_p, N] float32 tile
            lives in registers, and smaller tiles give a decode batch more programs.

    Raises:
        KernelArgumentError: a tensor of the wrong shape, dtype or device, or a bad dt_limit.
    """
    _check(x, dt, A, B, C, D, dt_bias, state, query_start, slots, has_state, dt_limit)
    num_heads, head_dim = x.shape[1], x.shape[2]
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if slots.shape[0] == 0 or num_heads == 0 or head_dim == 0:
        return out
    block_p = min(block_p, triton.next_power_of_2(head_dim))
    _selective_scan_kernel[(slots.shape[0], num_heads, triton.cdiv(head_dim, block_p))](
        x,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        state,
        query_start,
        slots,
        has_state,
        out,
        *_scalar_arguments(x, dt, B, C, state, dt_limit),
        ROUND=x.dtype != torch.float32,
        SKIP_IN_X_DTYPE=torch.promote_types(x.dtype, D.dtype) == x.dtype,
        BLOCK_P=block_p,
        BLOCK_N=triton.next_power_of_2(B.shape[2]),
    )
    return out


def _softplus(dt: torch.Tensor) -> torch.Tensor:
    """F.softplus through torch's vectorised loop for every element (see the module
    docstring): a flat run padded to a multiple of SOFTPLUS_RUN, in calls a thread each."""
    flat = dt.flatten()
    if flat.numel() == 0:
        return F.softplus(dt)
    padded = F.pad(flat, (0, -flat.numel() % SOFTPLUS_RUN))
    result = torch.cat([F.softplus(run) for run in padded.split(SOFTPLUS_CALL)])
    return result[: flat.numel()].view(dt.shape)


def _output(recurrent: torch.Tensor, C: torch.Tensor, x: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """y [n, H, P] of one row of n sequences, by transformers' ops: recurrent [n, H, P, N]
    float32; C [n, H, N] and x [n, H, P] in x's dtype; D [H]."""
    num_sequences, num_heads, head_dim, state_size = recurrent.shape
    readout = recurrent.to(C.dtype).view(num_sequences * num_heads, head_dim, state_size)
    y = torch.bmm(readout, C.reshape(num_sequences * num_heads, state_size, 1)).view(x.shape)
    return (y + x * D[:, None]).to(y.dtype)


def selective_scan_torch(
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
    """The reference, and the CPU path: same arguments and result as `selective_scan`.

    Token by token over the batch's sequences, their states [n, H, P, N] (kernels/state_rows.py)."""
    _check(x, dt, A, B, C, D, dt_bias, state, query_start, slots, has_state, dt_limit)
    heads_per_group = x.shape[1] // B.shape[1]
    dt = torch.clamp(_softplus(dt + dt_bias.to(dt.dtype)), min=dt_limit[0], max=dt_limit[1])
    decay = torch.exp(dt.float() * A.float())  # [T, H]; exp gives an element the same bits anywhere
    B = B.repeat_interleave(heads_per_group, dim=1)
    C = C.repeat_interleave(heads_per_group, dim=1)
    dB = dt[..., None] * B  # [T, H, N], x's dtype
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)

    def step(recurrent: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        rows_x = x[rows]
        recurrent = recurrent * decay[rows][..., None, None] + dB[rows][:, :, None, :] * rows_x[..., None]
        out[rows] = _output(recurrent, C[rows], rows_x, D)
        return recurrent

    recur_by_rows(state, query_start, slots, has_state, step)
    return out
