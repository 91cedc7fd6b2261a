"""The gated delta rule of gated_delta_rule.py in its chunked form (FLA's, and transformers'
`torch_chunk_gated_delta_rule`): C rows at a time by matrix products, so a long prompt's
prefill is a loop over its chunks instead of over its tokens.

    shapes and state slots as gated_delta_rule.py, plus
    start_positions [N] int32/int64: the absolute position of sequence i's first row in this
                    call (how many of its tokens its slot's state already holds)

Where chunks fall. The chunked form's sums are not the recurrent form's, so a token's bits
depend on where its sequence was cut into chunks. Cuts are therefore fixed by absolute
position, never by the call: a chunk is rows [p, p + C) with p a multiple of C, counted
from the sequence's first token, that lie wholly within the call's rows. Every other row
goes through the recurrent update (gated_delta_rule.py's), one row at a time, in order:

    start_position 12, C = 8, 23 rows:
    positions  12 13 14 15 | 16 ........ 23 | 24 ........ 31 | 32 33 34
               recurrent     chunk            chunk            recurrent (a partial chunk)

So a sequence's outputs and its state after its first k*C tokens are the same bits whatever
shares the batch and wherever its calls were cut, provided every cut falls on a multiple
of C except those after a prompt's last rows and between decode rows. The engine passes
its block size as C: it cuts chunked prefill and takes state snapshots at multiples of it.
A call that starts off alignment (at 12 above) gives the bits of the same rows cut at its
first boundary (12..15, then 16 on), not those of one call from 0 (where 8..15 were a chunk).
Rows that went through the recurrent update (a prompt's partial last chunk, decode rows)
would not give the bits they would inside a whole chunk of a longer call, such as a
recompute of prompt and output after a preemption: `chunk_limits` (the engine's: each
prompt's length rounded down to a chunk) keeps every row past it recurrent, so such a
call gives the bits of the prompt's chunks and then its decode rows. (A later prompt that
holds this one's output is its own prompt: its cold run and its runs resumed from a
snapshot at a block boundary are cut at the same places.)

Agreement: with the recurrent form to float32 rounding (the same sums in another order);
with transformers' chunked form to rounding when its chunk_size is C and the sequence starts
at position 0 (the same chunks; it solves the triangular system by `solve_triangular`, this
module by the forward substitution transformers uses when exporting).

`chunked_gated_delta_rule_torch` is the reference: one sequence at a time, its recurrent rows
by gated_delta_rule.py's row step on [1, Hv, ...], each chunk by transformers' ops for one
chunk in float32 on [Hv, C, ...]; the shapes never depend on the batch or the call.
`chunked_gated_delta_rule` is the Triton kernel: one program per (sequence, value head, tile
of Dv columns) walks its rows and chunks in order with its [Dk, tile] slice of the state in
registers; the chunk's triangular solve is a loop over its C rows. Its sums are not torch's,
so it agrees with the reference to float32 rounding; it is invariant bit for bit (a
program's operations depend on neither the batch nor the call's cut).

Preconditions no check can see without a device sync: those of gated_delta_rule.py, and
start_positions >= 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.kernels.checks import check_chunk_arguments
from pagefleet.kernels.gated_delta_rule import (
    L2NORM_EPS,
    _check,
    _l2norm,
    _program_tile,
    _recurrent_step,
    _row_step,
)

DOT_BLOCK = 16  # tl.dot's smallest tile side on NVIDIA GPUs: smaller chunks and heads are padded to it


def _check_chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    start_positions: torch.Tensor,
    chunk_limits: torch.Tensor | None,
    chunk_size: int,
) -> None:
    _check(query, key, value, g, beta, state, query_start, slots, has_state)
    check_chunk_arguments(start_positions, chunk_limits, chunk_size, slots, query.device)


@triton.jit
def _wy_inverse(ut_system, rows, CHUNK: tl.constexpr):
    """(I + strictly lower part of ut_system)^-1 [BLOCK_C, BLOCK_C] by forward substitution,
    row by row, as transformers' loop computes it (padding rows past CHUNK stay identity)."""
    solve = tl.where(rows[:, None] > rows[None, :], -ut_system, 0.0)
    for i in range(1, CHUNK):
        pick = rows[:, None] == i
        row = tl.sum(tl.where(pick, solve, 0.0), axis=0)  # row i; only its first i entries are set
        solve = tl.where(pick, (row + tl.sum(row[:, None] * solve, axis=0))[None, :], solve)
    return tl.where(rows[:, None] == rows[None, :], 1.0, solve)


@triton.jit
def _chunk_rows(
    first,
    pointers,
    strides,
    dim_ok,
    column_ok,
    query_scale,
    eps,
    L2NORM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """q, k [BLOCK_C, BLOCK_K], v [BLOCK_C, BLOCK_V], g, beta [BLOCK_C] of rows first..+CHUNK
    in float32, q and k normalised; padding rows are 0 (g 0: no decay), so they change nothing."""
    q_at, k_at, v_at, g_at, beta_at, _ = pointers
    stride_qt, stride_kt, stride_vt, stride_gt, stride_bt, _ = strides
    rows = tl.arange(0, BLOCK_C)
    row_ok = rows < CHUNK
    at = (first + rows)[:, None]
    key_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_at[None, :] + at * stride_qt, mask=key_mask, other=0.0).to(tl.float32)
    k = tl.load(k_at[None, :] + at * stride_kt, mask=key_mask, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, axis=1) + eps)[:, None]
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=1) + eps)[:, None]
    v = tl.load(v_at[None, :] + at * stride_vt, mask=row_ok[:, None] & column_ok[None, :], other=0.0)
    g = tl.load(g_at + (first + rows) * stride_gt, mask=row_ok, other=0.0)
    beta = tl.load(beta_at + (first + rows) * stride_bt, mask=row_ok, other=0.0).to(tl.float32)
    return q / query_scale, k, v.to(tl.float32), g, beta


@triton.jit
def _chunk_step(
    recurrent,
    first,
    pointers,
    strides,
    dim_ok,
    column_ok,
    query_scale,
    eps,
    L2NORM: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Rows first..first+CHUNK at once, transformers' chunked form for one chunk; writes their
    outputs and returns the state after them."""
    q, k, v, g, beta = _chunk_rows(
        first, pointers, strides, dim_ok, column_ok, query_scale, eps, L2NORM, CHUNK, BLOCK_C
    )
    rows = tl.arange(0, BLOCK_C)
    cum = tl.cumsum(g, axis=0)  # log decay from the chunk's start to each row
    last = tl.sum(tl.where(rows == CHUNK - 1, cum, 0.0), axis=0)
    # decay between rows j <= i, masked before exp as transformers does (no overflow above)
    pairwise = tl.exp(tl.where(rows[:, None] >= rows[None, :], cum[:, None] - cum[None, :], -float("inf")))
    k_beta = k * beta[:, None]
    inverse = _wy_inverse(tl.dot(k_beta, tl.trans(k), input_precision="ieee") * pairwise, rows, CHUNK)
    new_values = tl.dot(inverse, v * beta[:, None], input_precision="ieee")
    k_cumdecay = tl.dot(inverse, k_beta * tl.exp(cum)[:, None], input_precision="ieee")
    v_new = new_values - tl.dot(k_cumdecay, recurrent, input_precision="ieee")
    intra = tl.dot(q, tl.trans(k), input_precision="ieee") * pairwise
    out = tl.dot(q * tl.exp(cum)[:, None], recurrent, input_precision="ieee")
    out = out + tl.dot(intra, v_new, input_precision="ieee")
    out_at = pointers[5]
    out_mask = (rows < CHUNK)[:, None] & column_ok[None, :]
    tl.store(out_at[None, :] + (first + rows)[:, None] * strides[5], out.to(out_at.dtype.element_ty), mask=out_mask)
    k_decayed = k * tl.exp(last - cum)[:, None]
    return recurrent * tl.exp(last) + tl.dot(tl.trans(k_decayed), v_new, input_precision="ieee")


@triton.jit
def _bounds(
    query_start_ptr, start_positions_ptr, chunk_limits_ptr, sequence, HAS_LIMITS: tl.constexpr, CHUNK: tl.constexpr
):
    """(start, chunks_from, chunks_to, end) of a sequence: its rows [start, end), of which
    [chunks_from, chunks_to) are whole chunks, as `_pieces` places them."""
    start = tl.load(query_start_ptr + sequence).to(tl.int64)
    end = tl.load(query_start_ptr + sequence + 1).to(tl.int64)
    position = tl.load(start_positions_ptr + sequence).to(tl.int64)
    chunkable_end = end  # rows from here on are never chunked: at or past the sequence's limit
    if HAS_LIMITS:
        limit = tl.load(chunk_limits_ptr + sequence).to(tl.int64)
        chunkable_end = start + tl.maximum(tl.minimum(limit - position, end - start), 0)
    chunks_from = start + tl.minimum((CHUNK - position % CHUNK) % CHUNK, chunkable_end - start)
    return start, chunks_from, chunks_from + (chunkable_end - chunks_from) // CHUNK * CHUNK, end


@triton.jit
def _chunked_gated_delta_rule_kernel(
    query_ptr,
    key_ptr,
    value_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    query_start_ptr,
    slots_ptr,
    has_state_ptr,
    start_positions_ptr,
    chunk_limits_ptr,  # read only with HAS_LIMITS
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
    query_scale,  # sqrt(Dk): q is divided by it, as in gated_delta_rule.py
    eps,
    L2NORM: tl.constexpr,
    HAS_LIMITS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
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
    bounds = _bounds(query_start_ptr, start_positions_ptr, chunk_limits_ptr, sequence, HAS_LIMITS, CHUNK)
    start, chunks_from, chunks_to, end = bounds
    for row in range(start, chunks_from):
        recurrent = _row_step(recurrent, row, pointers, strides, dim_ok, column_ok, query_scale, eps, L2NORM)
    for first in range(chunks_from, chunks_to, CHUNK):
        recurrent = _chunk_step(
            recurrent, first, pointers, strides, dim_ok, column_ok, query_scale, eps, L2NORM, CHUNK, BLOCK_C
        )
    for row in range(chunks_to, end):
        recurrent = _row_step(recurrent, row, pointers, strides, dim_ok, column_ok, query_scale, eps, L2NORM)
    tl.store(state_at, recurrent, mask=tile_mask)


def chunked_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    start_positions: torch.Tensor,
    chunk_limits: torch.Tensor | None = None,
    chunk_size: int = 16,
    use_qk_l2norm: bool = True,
    block_v: int = 64,
) -> torch.Tensor:
    """out [T, Hv, Dv] in value's dtype: the module docstring's chunks and rows; state's slots
    of the batch are overwritten in place with each sequence's final state, the others untouched.

    Args:
        query, key, value, g, beta, state, query_start, slots, has_state, use_qk_l2norm: as
            `gated_delta_rule` (gated_delta_rule.py).
        start_positions: [N] int32/int64, each sequence's absolute position of its first row.
        chunk_limits: [N] int32/int64 or None: no chunk reaches past position chunk_limits[i]
            (the engine's: its prompt's length rounded down to a chunk), rows there are
            recurrent; None: no limit.
        chunk_size: C, a power of two; chunks lie at its multiples (the engine's block size).
        block_v: Dv columns per program (a power of 2; at least 16 are used, for tl.dot).

    Raises:
        KernelArgumentError: a tensor of the wrong shape, dtype or device, or a bad chunk_size.
    """
    _check_chunked(
        query, key, value, g, beta, state, query_start, slots, has_state, start_positions, chunk_limits, chunk_size
    )
    num_tokens, num_key_heads, key_dim = query.shape
    num_heads, value_dim = value.shape[1], value.shape[2]
    out = torch.zeros(num_tokens, num_heads, value_dim, dtype=value.dtype, device=value.device)
    if slots.shape[0] == 0 or num_heads == 0 or value_dim == 0:
        return out
    block_v = max(min(block_v, triton.next_power_of_2(value_dim)), DOT_BLOCK)
    _chunked_gated_delta_rule_kernel[(slots.shape[0], num_heads, triton.cdiv(value_dim, block_v))](
        query,
        key,
        value,
        g,
        beta,
        state,
        query_start,
        slots,
        has_state,
        start_positions,
        chunk_limits if chunk_limits is not None else start_positions,
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
        HAS_LIMITS=chunk_limits is not None,
        CHUNK=chunk_size,
        BLOCK_C=max(chunk_size, DOT_BLOCK),
        BLOCK_K=max(triton.next_power_of_2(key_dim), DOT_BLOCK),
        BLOCK_V=block_v,
    )
    return out


def _wy_inverse_torch(ut_system: torch.Tensor) -> torch.Tensor:
    """[Hv, C, C] -> (I + its strictly lower part)^-1: transformers' forward substitution."""
    chunk_size = ut_system.shape[-1]
    solve = -ut_system.tril(-1)
    for i in range(1, chunk_size):
        row = solve[..., i, :i].clone()
        sub = solve[..., :i, :i].clone()
        solve[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    return solve + torch.eye(chunk_size, dtype=solve.dtype, device=solve.device)


def _chunk_step_torch(
    recurrent: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of one sequence, all float32: recurrent [Hv, Dk, Dv]; query, key [C, Hv, Dk];
    value [C, Hv, Dv]; g, beta [C, Hv]. Returns (the state after it, its output [C, Hv, Dv]) by
    transformers' ops for one chunk. Inputs are copied to fresh [Hv, C, ...] tensors, so the
    products never see where the rows sat in the batch."""
    query, key, value = (tensor.transpose(0, 1).contiguous() for tensor in (query, key, value))
    g, beta = g.T.contiguous(), beta.T.contiguous()
    upper = torch.ones(g.shape[-1], g.shape[-1], dtype=torch.bool, device=g.device).triu(1)
    cum = g.cumsum(dim=-1)
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    k_beta = key * beta.unsqueeze(-1)
    inverse = _wy_inverse_torch((k_beta @ key.transpose(-1, -2)) * pairwise)
    new_values = inverse @ (value * beta.unsqueeze(-1))
    k_cumdecay = inverse @ (k_beta * cum.exp().unsqueeze(-1))
    v_new = new_values - k_cumdecay @ recurrent
    intra = (query @ key.transpose(-1, -2)) * pairwise
    out = (query * cum.exp().unsqueeze(-1)) @ recurrent + intra @ v_new
    last = cum[:, -1:]
    k_decayed = key * (last - cum).exp().unsqueeze(-1)
    recurrent = recurrent * last.exp().unsqueeze(-1) + k_decayed.transpose(-1, -2) @ v_new
    return recurrent, out.transpose(0, 1)


def _pieces(position: int, start: int, end: int, chunk_size: int, limit: int | None) -> list[tuple[int, int, bool]]:
    """Rows [start, end) of a sequence whose row `start` sits at absolute `position`, as
    (first, last, is_chunk) in order: whole aligned chunks below `limit` (if any), single
    recurrent rows around them."""
    chunkable_end = end if limit is None else start + max(min(limit - position, end - start), 0)
    chunks_from = start + min(-position % chunk_size, chunkable_end - start)
    chunks_to = chunks_from + (chunkable_end - chunks_from) // chunk_size * chunk_size
    chunks = [(first, first + chunk_size, True) for first in range(chunks_from, chunks_to, chunk_size)]
    head, tail = range(start, chunks_from), range(chunks_to, end)
    return [(row, row + 1, False) for row in head] + chunks + [(row, row + 1, False) for row in tail]


def _run_sequence(
    recurrent: torch.Tensor, rows: tuple[torch.Tensor, ...], pieces: list[tuple[int, int, bool]], out: torch.Tensor
) -> torch.Tensor:
    """One sequence's pieces of the prepared (query, key, value, g, beta) rows, from state
    recurrent [Hv, Dk, Dv]; writes their outputs to `out` and returns the final state."""
    for first, last, is_chunk in pieces:
        piece = tuple(tensor[first:last] for tensor in rows)
        if is_chunk:
            recurrent, out[first:last] = _chunk_step_torch(recurrent, *piece)
        else:
            state, out[first:last] = _recurrent_step(recurrent[None], *piece)
            recurrent = state[0]
    return recurrent


def _prepared(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, l2norm: bool
) -> tuple[torch.Tensor, ...]:
    """(query, key [T, Hv, Dk], value [T, Hv, Dv], g, beta [T, Hv]) in float32, q and k
    normalised and repeated per value head, as `gated_delta_rule_torch` prepares them."""
    heads_per_key = value.shape[1] // query.shape[1]
    query, key = query.float(), key.float()
    if l2norm:  # per vector, so before repeat_interleave gives the same bits
        query, key = _l2norm(query), _l2norm(key)
    query = (query / (query.shape[-1] ** 0.5)).repeat_interleave(heads_per_key, dim=1)
    return query, key.repeat_interleave(heads_per_key, dim=1), value.float(), g, beta.float()


def chunked_gated_delta_rule_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    start_positions: torch.Tensor,
    chunk_limits: torch.Tensor | None = None,
    chunk_size: int = 16,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """The reference: same arguments (but block_v) and result as `chunked_gated_delta_rule`.

    A Python loop over sequences and their pieces (`_pieces`), each state [Hv, Dk, Dv]."""
    _check_chunked(
        query, key, value, g, beta, state, query_start, slots, has_state, start_positions, chunk_limits, chunk_size
    )
    rows = _prepared(query, key, value, g, beta, use_qk_l2norm)
    limits = chunk_limits.tolist() if chunk_limits is not None else [None] * slots.shape[0]
    out = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
    bounds, positions = query_start.tolist(), start_positions.tolist()
    for sequence, (slot, resume) in enumerate(zip(slots.tolist(), has_state.tolist(), strict=True)):
        # contiguous and fresh: a chunk's products see one layout whatever came before
        recurrent = torch.zeros(state.shape[1:], dtype=state.dtype, device=state.device)
        if resume:
            recurrent = state[slot].clone(memory_format=torch.contiguous_format)
        pieces = _pieces(positions[sequence], bounds[sequence], bounds[sequence + 1], chunk_size, limits[sequence])
        state[slot] = _run_sequence(recurrent, rows, pieces, out)
    return out.to(value.dtype)
