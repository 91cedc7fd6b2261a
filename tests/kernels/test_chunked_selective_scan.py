"""The chunked selective scan against transformers' chunked form, the recurrent scans, and
itself cut and batched in different ways.

The torch reference is close to transformers' `mamba2_chunk_scan` (the same chunks) for
sequences from position 0, and to the recurrent `selective_scan_torch` for any lengths,
starts, group counts and chunk limits; its rows outside whole chunks are the recurrent
scan's bits (the Triton kernel's, the recurrent kernel's). The Triton kernel (interpreted)
agrees with the reference to float32 rounding, bfloat16 outputs to bfloat16 rounding. Both
give a sequence the same bits alone or batched and whether its calls were cut at multiples
of the chunk size or not at all, in float32 and bfloat16; a call starting off alignment is
the same as that call cut at its first chunk boundary. Sizes are small and not powers of two
(head dim 20 in two tiles of 16, state 12 in a block of 16, chunks of 8 padded to 16), so
every mask runs. For the interpreter's time, the kernel's tests but one take P in one tile of
32 (half the programs), and bfloat16's split invariance in it one way of cutting, the longest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_chunk_scan

from pagefleet.kernels.checks import KernelArgumentError
from pagefleet.kernels.chunked_selective_scan import chunked_selective_scan, chunked_selective_scan_torch
from pagefleet.kernels.selective_scan import NO_LIMIT, selective_scan, selective_scan_torch
from tests.kernels.state_inputs import cat, chunked_batch, packed_scan_rows, scan_inputs, starts, take

Shape = tuple[int, int, int, int]  # (heads H, groups G, head dim P, state size N)
SHAPE: Shape = (2, 1, 20, 12)  # two heads share a group
WIDE: Shape = (4, 2, 20, 12)  # two groups of two heads: for the tests that compare forms
NUM_SLOTS = 7
CHUNK = 8
TOLERANCE: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
CHUNK_SIZES = pytest.mark.parametrize("chunk_size", [8, 16])
IMPLEMENTATIONS = pytest.mark.parametrize(
    "triton", [False, pytest.param(True, marks=pytest.mark.triton)], ids=["torch", "triton"]
)

Rows = tuple[torch.Tensor, ...]  # (x, dt, B, C), each [T, ...]
Params = tuple[torch.Tensor, ...]  # (A, D, dt_bias), each [H]


def _params(dtype: torch.dtype = torch.float32, shape: Shape = SHAPE) -> Params:
    """A float32 as the layer computes it; softplus(dt + dt_bias) near 0.13, as trained models'."""
    generator = torch.Generator().manual_seed(0)
    A = -torch.exp(torch.randn(shape[0], generator=generator) * 0.5)
    D = torch.randn(shape[0], generator=generator).to(dtype)
    dt_bias = (torch.randn(shape[0], generator=generator) * 0.5 - 2.0).to(dtype)
    return A, D, dt_bias


def _rows(num_rows: int, dtype: torch.dtype, seed: int = 1, shape: Shape = SHAPE) -> Rows:
    heads, groups, head_dim, state_size = shape
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, heads, head_dim, generator=generator).to(dtype)
    dt = torch.randn(num_rows, heads, generator=generator).to(dtype)
    B, C = (torch.randn(num_rows, groups, state_size, generator=generator).to(dtype) for _ in range(2))
    return x, dt, B, C


def _state(seed: int = 2, shape: Shape = SHAPE) -> torch.Tensor:
    heads, _, head_dim, state_size = shape
    return torch.randn(NUM_SLOTS, heads, head_dim, state_size, generator=torch.Generator().manual_seed(seed))


def _chunked(triton: bool) -> Callable[..., torch.Tensor]:
    """The reference, or the kernel with P in one tile of 32 (see the module docstring)."""
    return functools.partial(chunked_selective_scan, block_p=32) if triton else chunked_selective_scan_torch


def _recurrent(triton: bool) -> Callable[..., torch.Tensor]:
    """The recurrent scan `_chunked(triton)`'s rows outside chunks equal: the kernel with the
    same tiles (32 rows of P, 16 of N), so the same ops on the same shapes."""
    return functools.partial(selective_scan, block_p=32) if triton else selective_scan_torch


@CHUNK_SIZES
def test_reference_is_close_to_transformers_chunked_form(chunk_size: int) -> None:
    """Prompts of 16 and 21 rows from zeros at position 0 in one call (their slots hold
    garbage), each against `mamba2_chunk_scan` with the same chunk size: the same whole
    chunks; its last partial chunk is padded, ours recurrent rows."""
    lengths, slots = (16, 21), (3, 0)
    rows, params, state = _rows(sum(lengths), torch.float32, shape=WIDE), _params(shape=WIDE), _state(shape=WIDE)
    A, D, dt_bias = params
    out = chunked_selective_scan_torch(
        *scan_inputs(rows, params), state, *chunked_batch(lengths, slots, (False, False), (0, 0)), chunk_size=chunk_size
    )
    for (start, end), slot in zip(starts(lengths), slots, strict=True):
        x, dt, B, C = (tensor[None] for tensor in take(rows, start, end))
        theirs, theirs_state = mamba2_chunk_scan(
            x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True, return_final_states=True
        )
        torch.testing.assert_close(out[start:end], theirs[0], **TOLERANCE[torch.float32])
        torch.testing.assert_close(state[slot], theirs_state[0], **TOLERANCE[torch.float32])


@DTYPES
@pytest.mark.parametrize("limits", [None, (4, 5, 20, 30)], ids=["no-limits", "limits"])
@pytest.mark.parametrize("shape", [WIDE, (4, 1, 8, 16), (3, 3, 5, 7)], ids=["G2", "G1", "G3"])
def test_reference_is_close_to_the_recurrent_form(
    dtype: torch.dtype, limits: tuple[int, ...] | None, shape: Shape
) -> None:
    """Lengths 1, 5, 17 and 40 at positions 3, 0, 12 and 0, mixed has_state, chunks of 8:
    a decode row, whole chunks and partial ones (with limits, the 17 rows all recurrent, their
    chunk 16..23 past the limit 20, and the 40's last 16), against `selective_scan_torch`. In
    bfloat16 a chunk rounds once, the recurrent form at each step: bfloat16's tolerance."""
    lengths, slots, has_state, positions = (1, 5, 17, 40), (3, 0, 5, 1), (True, False, True, False), (3, 0, 12, 0)
    inputs, before = scan_inputs(_rows(sum(lengths), dtype, shape=shape), _params(dtype, shape)), _state(shape=shape)
    batch = chunked_batch(lengths, slots, has_state, positions)
    expected_state, state = before.clone(), before.clone()
    expected = selective_scan_torch(*inputs, expected_state, *batch[:3])
    chunk_limits = torch.tensor(limits) if limits is not None else None
    out = chunked_selective_scan_torch(*inputs, state, *batch, chunk_limits, chunk_size=CHUNK)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, expected_state, **TOLERANCE[dtype])


@IMPLEMENTATIONS
@DTYPES
def test_rows_outside_whole_chunks_are_the_recurrent_forms_bits(triton: bool, dtype: torch.dtype) -> None:
    """5 rows at positions 3..7 (no whole chunk of 8) from a stored state, beside 3 decode
    rows from 16 held back by their limit 16: the recurrent scan's bits."""
    inputs, before = scan_inputs(_rows(8, dtype), _params(dtype)), _state()
    batch = chunked_batch((5, 3), (4, 1), (True, True), (3, 16))
    expected_state, state = before.clone(), before.clone()
    expected = _recurrent(triton)(*inputs, expected_state, *batch[:3])
    out = _chunked(triton)(*inputs, state, *batch, torch.tensor([8, 16]), chunk_size=CHUNK)
    assert torch.equal(out, expected)
    assert torch.equal(state, expected_state)


@pytest.mark.parametrize(
    "dtype, param_dtype, dt_limit, chunk_size, limits, block_p",
    [
        (torch.float32, torch.float32, (0.05, 0.2), 16, None, 16),  # clamps about half of the dts
        (torch.float32, torch.float32, NO_LIMIT, 8, (8, 5, 4, 24, 35), 32),
        (torch.bfloat16, torch.bfloat16, NO_LIMIT, 8, None, 32),
        (torch.bfloat16, torch.float32, NO_LIMIT, 8, None, 32),  # D * x in float32, not rounded to x's dtype
    ],
    ids=["fp32-clamped", "fp32-limits", "bf16", "bf16-fp32-params"],
)
@pytest.mark.triton
def test_triton_matches_the_reference(
    dtype: torch.dtype,
    param_dtype: torch.dtype,
    dt_limit: tuple[float, float],
    chunk_size: int,
    limits: tuple[int, ...] | None,
    block_p: int,
) -> None:
    """Lengths 1, 5, 0, 17 and 40 at positions 7, 0, 4, 12 and 0, mixed has_state, P in two
    tiles of 16 or one of 32, x, dt, B and C views into one projection. The state is float32 from the same
    inputs whatever their dtype, so it is compared at float32's tolerance. Chunks in the wrong
    place would pass here too (both forms agree to rounding): the bit-for-bit tests see them."""
    lengths, slots, positions = (1, 5, 0, 17, 40), (3, 0, 6, 5, 1), (7, 0, 4, 12, 0)
    inputs = scan_inputs(packed_scan_rows(_rows(sum(lengths), dtype, shape=WIDE)), _params(param_dtype, WIDE))
    before = _state(shape=WIDE)
    batch = chunked_batch(lengths, slots, (True, False, True, True, False), positions)
    chunk_limits = torch.tensor(limits) if limits is not None else None
    expected_state, state = before.clone(), before.clone()
    expected = chunked_selective_scan_torch(
        *inputs, expected_state, *batch, chunk_limits, chunk_size=chunk_size, dt_limit=dt_limit
    )
    out = chunked_selective_scan(
        *inputs, state, *batch, chunk_limits, chunk_size=chunk_size, dt_limit=dt_limit, block_p=block_p
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, expected_state, **TOLERANCE[torch.float32])
    assert torch.equal(state[6], before[6]), "a sequence without rows changed its state"
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in slots]
    assert torch.equal(state[untouched], before[untouched])


# Our 37 rows (slot 2, from zeros) in calls of these lengths: one call; cuts at multiples of
# 8 with a partial chunk last; a prompt of 35 rows (cut at 32) then two decode rows.
CUT_NAMES = {(37,): "whole", (16, 8, 13): "aligned", (32, 3, 1, 1): "decode"}


def _in_company(part: int, cut: int, position: int) -> tuple[Rows, int]:
    """(the batch, index of ours): our cut at `position` among two other sequences, at
    another place in each call; theirs start off alignment (a chunk and partial rows)."""
    others = [(3, 0, 5), (11, 4, 6)]  # (length, slot, start position)
    others.insert(part % 3, (cut, 2, position))
    lengths, slots, positions = zip(*others, strict=True)
    return chunked_batch(lengths, slots, [slot != 2 or part > 0 for slot in slots], positions), part % 3


def _cut_case(triton: bool, dtype: torch.dtype, cuts: tuple[int, ...]) -> Any:
    """A case of the test below, named as torch-fp32-whole; the kernel's marked `triton`."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    case_id = f"{'triton' if triton else 'torch'}-{names[dtype]}-{CUT_NAMES[cuts]}"
    return pytest.param(triton, dtype, cuts, id=case_id, marks=[pytest.mark.triton] if triton else [])


@pytest.mark.parametrize(
    "triton, dtype, cuts",
    [
        *(_cut_case(False, dtype, cuts) for dtype in (torch.float32, torch.bfloat16) for cuts in CUT_NAMES),
        *(_cut_case(True, torch.float32, cuts) for cuts in CUT_NAMES),
        _cut_case(True, torch.bfloat16, (32, 3, 1, 1)),
    ],
)
def test_the_same_bits_alone_split_or_batched(triton: bool, dtype: torch.dtype, cuts: tuple[int, ...]) -> None:
    """The path invariance the alignment rule exists for: our sequence alone in one call,
    against its rows cut into calls at multiples of the chunk size, each among others."""
    chunked, params = _chunked(triton), _params(dtype)
    rows = _rows(37, dtype)
    alone_state = _state()
    state = alone_state.clone()
    alone = chunked(
        *scan_inputs(rows, params), alone_state, *chunked_batch((37,), (2,), (False,), (0,)), chunk_size=CHUNK
    )
    outs, start = [], 0
    for part, cut in enumerate(cuts):
        batch, index = _in_company(part, cut, start)
        lengths = (batch[0][1:] - batch[0][:-1]).tolist()
        parts = [_rows(length, dtype, seed=20 + i) for i, length in enumerate(lengths)]
        parts[index] = take(rows, start, start + cut)
        out = chunked(*scan_inputs(cat(parts), params), state, *batch, chunk_size=CHUNK)
        outs.append(out[sum(lengths[:index]) :][:cut])
        start += cut
    assert torch.equal(torch.cat(outs), alone)
    assert torch.equal(state[2], alone_state[2])


@IMPLEMENTATIONS
def test_an_unaligned_call_is_cut_at_its_first_boundary(triton: bool) -> None:
    """Resuming at position 12 with chunks of 8: rows 12..31 in one call give the bits of
    rows 12..15 (recurrent: the recurrent scan's bits) then 16..31 (two chunks), and are
    close to the 32 rows in one call, whose rows 8..15 were a chunk."""
    chunked = _chunked(triton)
    rows, params, states = _rows(32, torch.float32), _params(), [_state() for _ in range(4)]

    def call(start: int, end: int, state: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        batch = chunked_batch((end - start,), (1,), (not fresh,), (start,))
        return chunked(*scan_inputs(take(rows, start, end), params), state, *batch, chunk_size=CHUNK)

    whole = call(0, 32, states[0], fresh=True)
    for state in states[1:]:
        call(0, 12, state, fresh=True)
    resumed = call(12, 32, states[1])
    head, tail = call(12, 16, states[2]), call(16, 32, states[2])
    assert torch.equal(resumed, torch.cat([head, tail]))
    assert torch.equal(states[1][1], states[2][1])
    batch = chunked_batch((4,), (1,), (True,), (12,))[:3]
    assert torch.equal(head, _recurrent(triton)(*scan_inputs(take(rows, 12, 16), params), states[3], *batch))
    torch.testing.assert_close(resumed, whole[12:], **TOLERANCE[torch.float32])
    torch.testing.assert_close(states[1][1], states[0][1], **TOLERANCE[torch.float32])


@IMPLEMENTATIONS
def test_a_first_chunk_ignores_what_its_slot_held(triton: bool) -> None:
    """has_state=False: a slot full of NaN gives the bits of a slot of zeros (a chunk of 8
    and 5 rows after it)."""
    batch, inputs = chunked_batch((13,), (1,), (False,), (0,)), scan_inputs(_rows(13, torch.float32), _params())
    results = []
    for fill in (float("nan"), 0.0):
        state = torch.full((NUM_SLOTS, *SHAPE[:1], *SHAPE[2:]), fill)
        results.append((_chunked(triton)(*inputs, state, *batch, chunk_size=CHUNK), state[1]))
    for garbage, zeros in zip(*results, strict=True):
        assert torch.equal(garbage, zeros)
    assert not results[0][0].isnan().any()


def _arguments() -> dict[str, Any]:
    rows = dict(zip(("x", "dt", "B", "C"), _rows(6, torch.float32), strict=True))
    params = dict(zip(("A", "D", "dt_bias"), _params(), strict=True))
    names = ("query_start", "slots", "has_state", "start_positions")
    batch = dict(zip(names, chunked_batch((1, 5), (0, 1), (True, False), (3, 0)), strict=True))
    return dict(**rows, **params, state=_state(), **batch, chunk_limits=torch.tensor([8, 4]), chunk_size=CHUNK)


MISTAKES: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    "x": ("x", lambda a: a["x"][0]),  # 2 dimensions
    "B": ("B", lambda a: torch.cat([a["B"]] * 3, dim=1)),  # 3 groups for 2 heads
    "state": ("state", lambda a: a["state"].bfloat16()),  # not float32
    "has_state": ("has_state", lambda a: a["has_state"].int()),
    "positions_shape": ("start_positions", lambda a: a["start_positions"][:1]),
    "positions_dtype": ("start_positions", lambda a: a["start_positions"].float()),
    "positions_device": ("start_positions", lambda a: a["start_positions"].to("meta")),
    "limits_shape": ("chunk_limits", lambda a: a["chunk_limits"][None]),
    "limits_dtype": ("chunk_limits", lambda a: a["chunk_limits"].bool()),
    "chunk_not_power_of_two": ("chunk_size", lambda a: 12),
    "chunk_zero": ("chunk_size", lambda a: 0),
    "chunk_float": ("chunk_size", lambda a: 8.0),
    "dt_limit": ("dt_limit", lambda a: (1.0, 0.0)),
}


@IMPLEMENTATIONS
@pytest.mark.parametrize("mistake", MISTAKES)
def test_rejects_bad_arguments(triton: bool, mistake: str) -> None:
    arguments = _arguments()
    name, wrong = MISTAKES[mistake]
    arguments[name] = wrong(arguments)
    with pytest.raises(KernelArgumentError, match=f"^{name}"):
        _chunked(triton)(**arguments)


@IMPLEMENTATIONS
def test_rows_past_the_chunk_limit_are_the_decode_rows_bits(triton: bool) -> None:
    """A recompute after preemption computes a prompt of 24 and its 10 output tokens in one
    call: with the limit at the prompt's 24, rows 24..33 run recurrently, so the call gives
    the bits of the prompt (three chunks) then ten one-row decode calls."""
    chunked, params = _chunked(triton), _params()
    rows, states = _rows(34, torch.float32), [_state() for _ in range(2)]

    def call(start: int, end: int, state: torch.Tensor, limits: torch.Tensor | None = None) -> torch.Tensor:
        batch = chunked_batch((end - start,), (1,), (start > 0,), (start,))
        return chunked(*scan_inputs(take(rows, start, end), params), state, *batch, limits, chunk_size=CHUNK)

    whole = call(0, 34, states[0], torch.tensor([24]))
    parts = [call(0, 24, states[1])] + [call(row, row + 1, states[1]) for row in range(24, 34)]
    assert torch.equal(whole, torch.cat(parts))
    assert torch.equal(states[0][1], states[1][1])
    unlimited = call(0, 34, _state())
    assert not torch.equal(unlimited[24:], whole[24:]), "without the limit rows 24..31 are a chunk"
