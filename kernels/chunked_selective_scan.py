"""Mamba-2's selective scan of selective_scan.py in its chunked form, the state space dual
("SSD") of transformers' `mamba2_chunk_scan`: C rows at a time by matrix products, so a long
prompt's prefill is a loop over its chunks instead of over its tokens.

    shapes, dtypes and state slots as selective_scan.py, plus
    start_positions [N] int32/int64: the absolute position of sequence i's first row in this
                    call (how many of its tokens its slot's state already holds)

Where chunks fall: as in chunked_gated_delta_rule.py (whose `_pieces` and `_bounds` this
module uses), and for the same reason. The chunked form's sums are not the recurrent form's,
so a chunk is rows [p, p + C) with p a multiple of C, counted from the sequence's first
token, that lie wholly within the call's rows and below `chunk_limits[i]`; every other row
goes through selective_scan.py's recurrent step, one row at a time, in order:

    start_position 12, C = 8, 23 rows:
    positions  12 13 14 15 | 16 ........ 23 | 24 ........ 31 | 32 33 34
               recurrent     chunk            chunk            recurrent (a partial chunk)

So a sequence's outputs and its state after its first k*C tokens are the same bits whatever
shares the batch and wherever its calls were cut, provided every cut falls on a multiple of
C except those after a prompt's last rows and between decode rows. `chunk_limits` (each
prompt's length rounded down to a chunk) keeps a recompute of prompt and output after a
preemption on the bits of the prompt's chunks and then its decode rows.

One chunk, per head, from the state S [P, N] before it, in float32 (dt as the recurrent step
rounds it: softplus and clamp in x's dtype, as transformers' chunked path does too):

    a_s = dt_s A,  cum_t = a_1 + ... + a_t                (s, t: the chunk's rows)
    L[t, s] = exp(a_{s+1} + ... + a_t) if s <= t else 0   (transformers' segment_sum: no
                                                           difference of two cumulative sums)
    y_t = sum_s L[t, s] (C_t . B_s) dt_s x_s  +  exp(cum_t) S C_t  +  D x_t
    S   = S exp(cum_C) + sum_s exp(cum_C - cum_s) dt_s x_s B_s^T

y_t is rounded to x's dtype once, as in transformers' chunked path; a recurrent row rounds
where transformers' decode step does (selective_scan.py). Agreement: with the recurrent form
to float32 rounding (the same sums in another order; in bfloat16 to its rounding), and with
`mamba2_chunk_scan` to rounding when its chunk_size is C and the sequence starts at 0.

`chunked_selective_scan_torch` is the reference: the rows before each sequence's first chunk,
then after its last, by `selective_scan_torch` itself on those rows (its bits depend on
neither the batch nor the cut), and each chunk by the ops above on fresh [H, C, ...] float32
tensors, one sequence at a time; the shapes never depend on the batch or the call.
`chunked_selective_scan` is the Triton kernel: one program per (sequence, head, tile of P)
walks its rows and chunks in order with its [tile, N] slice of the state in registers, a
recurrent row by selective_scan.py's `_row_step` (its kernel's), a chunk by tl.dot on tiles
padded to 16.
Its sums are not torch's, so it agrees with the reference to float32 rounding; it is
invariant bit for bit (a program's operations depend on neither the batch nor the cut).

Preconditions no check can see without a device sync: those of selective_scan.py, and
start_positions >= 0.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from pagefleet.kernels.checks import check_chunk_arguments
from pagefleet.kernels.chunked_gated_delta_rule import DOT_BLOCK, _bounds, _pieces
from pagefleet.kernels.selective_scan import (
    NO_LIMIT,
    _check,
    _dt,
    _program_tile,
    _round,
    _row_step,
    _scalar_arguments,
    _softplus,
    selective_scan_torch,
)


def _check_chunked(
    inputs: tuple[torch.Tensor, ...],
    state: torch.Tensor,
    sequences: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    start_positions: torch.Tensor,
    chunk_limits: torch.Tensor | None,
    chunk_size: int,
    dt_limit: tuple[float, float],
) -> None:
    """selective_scan.py's checks of (x, dt, A, B, C, D, dt_bias), state and (query_start,
    slots, has_state), then the chunks' arguments."""
    _check(*inputs, state, *sequences, dt_limit)
    check_chunk_arguments(start_positions, chunk_limits, chunk_size, sequences[1], inputs[0].device)


@triton.jit
def _chunk_rows(
    first, pointers, strides, dim_ok, n_ok, params, ROUND: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr
):
    """x [BLOCK_C, BLOCK_P], dt [BLOCK_C], B and C [BLOCK_C, BLOCK_N] of rows first..+CHUNK in
    float32; padding rows are 0 (dt 0: no decay), so they change nothing."""
    x_at, dt_at, b_at, c_at, _ = pointers
    stride_xt, stride_dt, stride_bt, stride_ct, _ = strides
    A, D, bias, dt_low, dt_high, threshold = params
    rows = tl.arange(0, BLOCK_C)
    row_ok = rows < CHUNK
    at = (first + rows)[:, None]
    x = tl.load(x_at[None, :] + at * stride_xt, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    B = tl.load(b_at[None, :] + at * stride_bt, mask=row_ok[:, None] & n_ok[None, :], other=0.0)
    C = tl.load(c_at[None, :] + at * stride_ct, mask=row_ok[:, None] & n_ok[None, :], other=0.0)
    raw = tl.load(dt_at + (first + rows) * stride_dt, mask=row_ok, other=0.0).to(tl.float32)
    dt = _dt(raw, bias, dt_low, dt_high, threshold, ROUND, x_at.dtype.element_ty)
    return x.to(tl.float32), tl.where(row_ok, dt, 0.0), B.to(tl.float32), C.to(tl.float32)


@triton.jit
def _chunk_step(
    recurrent,
    first,
    pointers,
    strides,
    dim_ok,
    n_ok,
    params,
    ROUND: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Rows first..first+CHUNK at once, the module docstring's chunk; writes their outputs and
    returns the state after them."""
    x, dt, B, C = _chunk_rows(first, pointers, strides, dim_ok, n_ok, params, ROUND, CHUNK, BLOCK_C)
    A, D = params[0], params[1]
    rows = tl.arange(0, BLOCK_C)
    a = dt * A
    cum = tl.cumsum(a, axis=0)  # log decay from the chunk's start to each row
    last = tl.sum(tl.where(rows == CHUNK - 1, cum, 0.0), axis=0)
    # segment sums [t, s] = a_{s+1} + ... + a_t: a cumulative sum down the strictly lower part
    segments = tl.cumsum(tl.where(rows[:, None] > rows[None, :], a[:, None], 0.0), axis=0)
    mask = tl.where(rows[:, None] >= rows[None, :], tl.exp(segments), 0.0)
    xdt = x * dt[:, None]
    scores = tl.dot(C, tl.trans(B), input_precision="ieee") * mask
    y = tl.dot(scores, xdt, input_precision="ieee")
    y = y + tl.dot(C, tl.trans(recurrent), input_precision="ieee") * tl.exp(cum)[:, None]
    y = y + x * D
    out_at = pointers[4]
    dtype = out_at.dtype.element_ty
    if ROUND:
        y = _round(y, dtype)  # so the store's cast is exact
    out_mask = (rows < CHUNK)[:, None] & dim_ok[None, :]
    tl.store(out_at[None, :] + (first + rows)[:, None] * strides[4], y.to(dtype), mask=out_mask)
    decayed = xdt * tl.exp(last - cum)[:, None]
    return recurrent * tl.exp(last) + tl.dot(tl.trans(decayed), B, input_precision="ieee")


@triton.jit
def _walk(
    recurrent,
    bounds,
    pointers,
    strides,
    dim_ok,
    n_ok,
    params,
    ROUND: tl.constexpr,
    SKIP_IN_X: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """A sequence's rows before its chunks, its chunks and its rows after them, in order, from
    the state `recurrent`; returns the state after its last row."""
    start, chunks_from, chunks_to, end = bounds
    for row in range(start, chunks_from):
        recurrent = _row_step(recurrent, row, pointers, strides, dim_ok, n_ok, params, ROUND, SKIP_IN_X)
    for first in range(chunks_from, chunks_to, CHUNK):
        recurrent = _chunk_step(recurrent, first, pointers, strides, dim_ok, n_ok, params, ROUND, CHUNK, BLOCK_C)
    for row in range(chunks_to, end):
        recurrent = _row_step(recurrent, row, pointers, strides, dim_ok, n_ok, params, ROUND, SKIP_IN_X)
    return recurrent


@triton.jit
def _chunked_selective_scan_kernel(
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
    start_positions_ptr,
    chunk_limits_ptr,  # read only with HAS_LIMITS
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
    SKIP_IN_X: tl.constexpr,  # and round D * x to it (torch's promotion of x and D)
    HAS_LIMITS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tensors = (x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, state_ptr, slots_ptr, has_state_ptr, out_ptr)
    row_strides = (stride_xt, stride_dt, stride_bt, stride_ct)
    other_strides = (stride_xh, stride_bg, stride_cg, stride_ss, stride_sh, stride_sp)
    scalars = (num_heads, heads_per_group, head_dim, state_size, dt_low, dt_high, threshold)
    tile = _program_tile(tensors, row_strides, other_strides, scalars, ROUND, BLOCK_P, BLOCK_N)
    pointers, strides, dim_ok, n_ok, params, state_at, tile_mask, recurrent = tile
    bounds = _bounds(query_start_ptr, start_positions_ptr, chunk_limits_ptr, tl.program_id(0), HAS_LIMITS, CHUNK)
    recurrent = _walk(recurrent, bounds, pointers, strides, dim_ok, n_ok, params, ROUND, SKIP_IN_X, CHUNK, BLOCK_C)
    tl.store(state_at, recurrent, mask=tile_mask)


def chunked_selective_scan(
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
    start_positions: torch.Tensor,
    chunk_limits: torch.Tensor | None = None,
    chunk_size: int = 16,
    dt_limit: tuple[float, float] = NO_LIMIT,
    block_p: int = 16,
) -> torch.Tensor:
    """y [T, H, P] in x's dtype: the module docstring's chunks and rows; state's slots of the
    batch are overwritten in place with each sequence's final state, the others untouched.

    Args:
        x, dt, A, B, C, D, dt_bias, state, query_start, slots, has_state, dt_limit: as
            `selective_scan` (selective_scan.py).
        start_positions: [N] int32/int64, each sequence's absolute position of its first row.
        chunk_limits: [N] int32/int64 or None: no chunk reaches past position chunk_limits[i]
            (the engine's: its prompt's length rounded down to a chunk), rows there are
            recurrent; None: no limit.
        chunk_size: C, a power of two; chunks lie at its multiples (the engine's block size).
        block_p: state rows (of P) per program, a power of 2 (at least 16 are used, for tl.dot).

    Raises:
        KernelArgumentError: a tensor of the wrong shape, dtype or device, or a bad chunk_size
            or dt_limit.
    """
    inputs, sequences = (x, dt, A, B, C, D, dt_bias), (query_start, slots, has_state)
    _check_chunked(inputs, state, sequences, start_positions, chunk_limits, chunk_size, dt_limit)
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if slots.shape[0] and x.shape[1] and x.shape[2]:
        chunk_args = (start_positions, chunk_limits if chunk_limits is not None else start_positions)
        _launch(inputs, state, sequences, chunk_args, out, chunk_size, dt_limit, block_p, chunk_limits is not None)
    return out


def _launch(
    inputs: tuple[torch.Tensor, ...],
    state: torch.Tensor,
    sequences: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    chunk_args: tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    chunk_size: int,
    dt_limit: tuple[float, float],
    block_p: int,
    has_limits: bool,
) -> None:
    """The kernel over (sequence, head, tile of P) for `chunked_selective_scan`'s checked
    arguments; chunk_args are (start_positions, chunk_limits or any [N] index tensor)."""
    x, dt, _, B, C, D, _ = inputs
    num_heads, head_dim = x.shape[1], x.shape[2]
    block_p = max(min(block_p, triton.next_power_of_2(head_dim)), DOT_BLOCK)
    _chunked_selective_scan_kernel[(sequences[1].shape[0], num_heads, triton.cdiv(head_dim, block_p))](
        *inputs,
        state,
        *sequences,
        *chunk_args,
        out,
        *_scalar_arguments(x, dt, B, C, state, dt_limit),
        ROUND=x.dtype != torch.float32,
        SKIP_IN_X=torch.promote_types(x.dtype, D.dtype) == x.dtype,
        HAS_LIMITS=has_limits,
        CHUNK=chunk_size,
        BLOCK_C=max(chunk_size, DOT_BLOCK),
        BLOCK_P=block_p,
        BLOCK_N=max(triton.next_power_of_2(B.shape[2]), DOT_BLOCK),
    )


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[H, C] -> [H, C, C]: [t, s] = a_{s+1} + ... + a_t for s <= t, -inf above; transformers'
    segment_sum (a cumulative sum down the masked columns, not a difference of two)."""
    size = a.shape[-1]
    lower = torch.ones(size, size, dtype=torch.bool, device=a.device).tril()
    sums = a[..., None].expand(*a.shape, size).masked_fill(~lower.tril(-1), 0.0).cumsum(dim=-2)
    return sums.masked_fill(~lower, float("-inf"))


def _chunk_step_torch(
    recurrent: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one sequence, all float32: recurrent [H, P, N]; x [C, H, P]; dt [C, H]
    (after softplus and clamp); B, C [C, H, N]; A, D [H]. Returns (the state after it, its
    output [C, H, P]) by the module docstring's ops. Inputs are copied to fresh [H, C, ...]
    tensors, so the products never see where the rows sat in the batch."""
    x, B, C = (tensor.transpose(0, 1).clone(memory_format=torch.contiguous_format) for tensor in (x, B, C))
    dt = dt.T.clone(memory_format=torch.contiguous_format)
    a = dt * A[:, None]
    cum = a.cumsum(dim=-1)
    xdt = x * dt[..., None]
    y = ((C @ B.transpose(-1, -2)) * _segment_sum(a).exp()) @ xdt
    y = y + (C @ recurrent.transpose(-1, -2)) * cum.exp()[..., None]
    y = y + x * D[:, None, None]
    last = cum[:, -1:]
    decayed = xdt * (last - cum).exp()[..., None]
    recurrent = recurrent * last.exp()[..., None] + decayed.transpose(-1, -2) @ B
    return recurrent, y.transpose(0, 1)


def _spans(position: int, start: int, end: int, chunk_size: int, limit: int | None) -> tuple[range, range, range]:
    """Rows [start, end) of a sequence whose row `start` sits at absolute `position`, as
    (recurrent rows before its chunks, the chunks' first rows, recurrent rows after them)."""
    firsts = [first for first, _, is_chunk in _pieces(position, start, end, chunk_size, limit) if is_chunk]
    if not firsts:
        return range(start, end), range(0), range(end, end)
    chunks_to = firsts[-1] + chunk_size
    return range(start, firsts[0]), range(firsts[0], chunks_to, chunk_size), range(chunks_to, end)


def _recurrent_rows(
    inputs: tuple[torch.Tensor, ...],
    state: torch.Tensor,
    runs: list[range],
    slots: torch.Tensor,
    has_state: torch.Tensor,
    dt_limit: tuple[float, float],
    out: torch.Tensor,
) -> None:
    """Run i (rows of sequence slots[i], maybe none) by `selective_scan_torch` on those rows
    gathered, its outputs written to `out`: its bits, as in a call of their own."""
    x, dt, A, B, C, D, dt_bias = inputs
    rows = torch.tensor([row for run in runs for row in run], dtype=torch.int64, device=x.device)
    bounds = torch.tensor([0, *itertools.accumulate(len(run) for run in runs)], dtype=torch.int32, device=x.device)
    gathered = (x[rows], dt[rows], A, B[rows], C[rows], D, dt_bias)
    out[rows] = selective_scan_torch(*gathered, state, bounds, slots, has_state, dt_limit)


def _prepared(inputs: tuple[torch.Tensor, ...], dt_limit: tuple[float, float]) -> tuple[torch.Tensor, ...]:
    """(x [T, H, P], dt [T, H], B, C [T, H, N]) in float32 for the chunks: dt after softplus
    and clamp in x's dtype as `selective_scan_torch` computes it, B and C repeated per head."""
    x, dt, _, B, C, _, dt_bias = inputs
    heads_per_group = x.shape[1] // B.shape[1]
    dt = torch.clamp(_softplus(dt + dt_bias.to(dt.dtype)), min=dt_limit[0], max=dt_limit[1])
    B, C = (tensor.float().repeat_interleave(heads_per_group, dim=1) for tensor in (B, C))
    return x.float(), dt.float(), B, C


def chunked_selective_scan_torch(
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
    start_positions: torch.Tensor,
    chunk_limits: torch.Tensor | None = None,
    chunk_size: int = 16,
    dt_limit: tuple[float, float] = NO_LIMIT,
) -> torch.Tensor:
    """The reference: same arguments (but block_p) and result as `chunked_selective_scan`.

    Three passes: every sequence's rows before its first chunk (from its slot or zeros, as
    has_state says), its chunks (a Python loop, each state [H, P, N]), its rows after them."""
    inputs, sequences = (x, dt, A, B, C, D, dt_bias), (query_start, slots, has_state)
    _check_chunked(inputs, state, sequences, start_positions, chunk_limits, chunk_size, dt_limit)
    bounds, positions = query_start.tolist(), start_positions.tolist()
    limits = chunk_limits.tolist() if chunk_limits is not None else [None] * slots.shape[0]
    spans = [
        _spans(position, bounds[i], bounds[i + 1], chunk_size, limit)
        for i, (position, limit) in enumerate(zip(positions, limits, strict=True))
    ]
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    _recurrent_rows(inputs, state, [head for head, _, _ in spans], slots, has_state, dt_limit, out)
    chunked = [(slot, firsts) for slot, (_, firsts, _) in zip(slots.tolist(), spans, strict=True) if firsts]
    rows = _prepared(inputs, dt_limit) if chunked else ()
    for slot, firsts in chunked:
        # contiguous and fresh: a chunk's products see one layout whatever came before
        recurrent = state[slot].clone(memory_format=torch.contiguous_format)
        for first in firsts:
            rows_x, rows_dt, rows_B, rows_C = (tensor[first : first + chunk_size] for tensor in rows)
            recurrent, out[first : first + chunk_size] = _chunk_step_torch(
                recurrent, rows_x, rows_dt, rows_B, rows_C, A, D
            )
        state[slot] = recurrent
    tails = [sequence for sequence, (_, _, tail) in enumerate(spans) if tail]
    if tails:
        index = torch.tensor(tails, dtype=torch.int64, device=slots.device)
        resume = torch.ones(len(tails), dtype=torch.bool, device=slots.device)
        _recurrent_rows(inputs, state, [spans[i][2] for i in tails], slots[index], resume, dt_limit, out)
    return out
