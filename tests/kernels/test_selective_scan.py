"""Mamba-2's selective scan (Granite 4's hybrid layers) against transformers and against
itself, on flat batches of sequences that each own a state slot.

The torch reference equals transformers' decode step `mamba2_selective_state_update` bit for
bit, in float32 and bfloat16, row by row through prefills and in batched decode steps from
stored states; it is close to transformers' chunked `mamba2_chunk_scan`. The Triton kernel
(interpreted) agrees with the reference to float32 rounding, its bfloat16 outputs to
bfloat16 rounding and its state, float32 from the same roundings, to float32 rounding.
Both give a sequence the same bits whether its rows come in one call or split across calls,
alone or among other sequences; a first chunk ignores what its slot held; slots outside the
batch keep their bits. The kernel's test uses a head dim of 6 in tiles of 4 and a state of
12 in a block of 16, so every mask runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    mamba2_chunk_scan,
    mamba2_selective_state_update,
)

from pagefleet.kernels.checks import KernelArgumentError
from pagefleet.kernels.selective_scan import NO_LIMIT, selective_scan, selective_scan_torch
from tests.kernels.state_inputs import cat, packed_scan_rows, scan_inputs, take

HEADS, GROUPS, HEAD_DIM, STATE_SIZE = 4, 2, 8, 16
NUM_SLOTS = 7
LENGTHS = (1, 5, 17)
TOLERANCE: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
IMPLEMENTATIONS = pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])

Rows = tuple[torch.Tensor, ...]  # (x, dt, B, C), each [T, ...]
Params = tuple[torch.Tensor, ...]  # (A, D, dt_bias), each [H]


def _batch(lengths: Sequence[int], slots: Sequence[int], has_state: Sequence[bool]) -> Rows:
    """(query_start int32 [N + 1], slots int64 [N], has_state bool [N])."""
    query_start = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return query_start, torch.tensor(slots, dtype=torch.int64), torch.tensor(has_state)


def _params(dtype: torch.dtype = torch.float32) -> Params:
    """A float32 as the layer computes it; softplus(dt + dt_bias) near 0.13, as trained models'."""
    generator = torch.Generator().manual_seed(0)
    A = -torch.exp(torch.randn(HEADS, generator=generator) * 0.5)
    D = torch.randn(HEADS, generator=generator).to(dtype)
    dt_bias = (torch.randn(HEADS, generator=generator) * 0.5 - 2.0).to(dtype)
    return A, D, dt_bias


def _rows(
    num_rows: int, dtype: torch.dtype, seed: int = 1, head_dim: int = HEAD_DIM, state_size: int = STATE_SIZE
) -> Rows:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, HEADS, head_dim, generator=generator).to(dtype)
    dt = torch.randn(num_rows, HEADS, generator=generator).to(dtype)
    B, C = (torch.randn(num_rows, GROUPS, state_size, generator=generator).to(dtype) for _ in range(2))
    return x, dt, B, C


def _state(seed: int = 2, head_dim: int = HEAD_DIM, state_size: int = STATE_SIZE) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, HEADS, head_dim, state_size, generator=torch.Generator().manual_seed(seed))


def _scan(triton: bool) -> Callable[..., torch.Tensor]:
    return selective_scan if triton else selective_scan_torch


def _their_step(state: torch.Tensor, rows: Rows, params: Params) -> torch.Tensor:
    """transformers' decode step for a batch of one row per sequence, its arguments expanded
    as GraniteMoeHybridMambaLayer expands them; state [b, H, P, N] is updated in place."""
    x, dt, B, C = rows
    A, D, dt_bias = params
    return mamba2_selective_state_update(
        state,
        x,
        dt[..., None].expand(-1, -1, HEAD_DIM),
        A[:, None, None].expand(-1, HEAD_DIM, STATE_SIZE),
        B,
        C,
        D[:, None].expand(-1, HEAD_DIM),
        z=None,
        dt_bias=dt_bias[:, None].expand(-1, HEAD_DIM),
        dt_softplus=True,
    )


@DTYPES
def test_reference_equals_transformers_step(dtype: torch.dtype) -> None:
    """Prefills of 1, 5 and 17 rows in one batch, two from stored states and one from zeros,
    against their step row by row; then three batched decode steps of all three from the
    states so stored, against their step on the batch. In bfloat16 too: the same casts."""
    rows, params, state, slots = _rows(sum(LENGTHS), dtype), _params(dtype), _state(), (3, 0, 5)
    has_state = (True, False, True)
    theirs_states = torch.stack(
        [
            state[slot] if stored else torch.zeros_like(state[slot])
            for slot, stored in zip(slots, has_state, strict=True)
        ]
    )
    out = selective_scan_torch(*scan_inputs(rows, params), state, *_batch(LENGTHS, slots, has_state))
    for sequence, (start, end) in enumerate(itertools.pairwise((0, *itertools.accumulate(LENGTHS)))):
        theirs_state = theirs_states[sequence : sequence + 1]  # a view: their step updates it in place
        for row in range(start, end):
            theirs = _their_step(theirs_state, take(rows, row, row + 1), params)
            assert torch.equal(out[row], theirs[0]), f"row {row}"
        assert torch.equal(state[slots[sequence]], theirs_state[0])
    for step in range(3):
        tokens = _rows(3, dtype, seed=10 + step)
        out = selective_scan_torch(*scan_inputs(tokens, params), state, *_batch((1, 1, 1), slots, (True,) * 3))
        assert torch.equal(out, _their_step(theirs_states, tokens, params))
        assert torch.equal(state[list(slots)], theirs_states)


def test_reference_is_close_to_the_chunked_form() -> None:
    """17 rows from a stored state, against transformers' chunked form in chunks of 8 (so
    the state crosses two chunk boundaries): another order of the same sums."""
    (x, dt, B, C), params, state = _rows(17, torch.float32), _params(), _state()
    A, D, dt_bias = params
    initial = state[4:5].clone()
    out = selective_scan_torch(x, dt, A, B, C, D, dt_bias, state, *_batch((17,), (4,), (True,)))
    theirs, theirs_state = mamba2_chunk_scan(
        x[None],
        dt[None],
        A,
        B[None],
        C[None],
        chunk_size=8,
        D=D,
        dt_bias=dt_bias,
        initial_states=initial,
        dt_softplus=True,
        return_final_states=True,
    )
    torch.testing.assert_close(out, theirs[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[4], theirs_state[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "dtype, param_dtype, dt_limit, block_p",
    [
        (torch.float32, torch.float32, (0.05, 0.2), 4),  # clamps about half of the dts; two tiles of 4
        (torch.bfloat16, torch.bfloat16, NO_LIMIT, 8),
        (torch.bfloat16, torch.float32, NO_LIMIT, 8),  # D * x in float32, not rounded to x's dtype
    ],
    ids=["fp32-clamped", "bf16", "bf16-fp32-params"],
)
def test_triton_matches_the_reference(
    dtype: torch.dtype, param_dtype: torch.dtype, dt_limit: tuple[float, float], block_p: int
) -> None:
    """Lengths 1, 5, 0 and 17, mixed has_state, x, dt, B and C views into one projection.
    The kernel rounds to bfloat16 where the reference does, so the state, float32 in both,
    is compared at float32's tolerance whatever the dtype."""
    head_dim, state_size = 6, 12
    lengths, slots = (1, 5, 0, 17), (3, 0, 6, 5)
    rows = packed_scan_rows(_rows(sum(lengths), dtype, head_dim=head_dim, state_size=state_size))
    params, before = _params(param_dtype), _state(head_dim=head_dim, state_size=state_size)
    batch = _batch(lengths, slots, (True, False, True, True))
    expected_state, state = before.clone(), before.clone()
    expected = selective_scan_torch(*scan_inputs(rows, params), expected_state, *batch, dt_limit=dt_limit)
    out = selective_scan(*scan_inputs(rows, params), state, *batch, dt_limit=dt_limit, block_p=block_p)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, expected_state, **TOLERANCE[torch.float32])
    assert torch.equal(state[6], before[6]), "a sequence without rows changed its state"
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in slots]
    assert torch.equal(state[untouched], before[untouched])


def _in_company(part: int, cut: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(lengths, slots, index of ours): chunk `part` of our sequence (slot 2) among others,
    at a different place in each call."""
    others = [(2, 0), (1, 4)]
    lengths, slots = [length for length, _ in others], [slot for _, slot in others]
    index = part % 3
    lengths.insert(index, cut)
    slots.insert(index, 2)
    return tuple(lengths), tuple(slots), index


@IMPLEMENTATIONS
@DTYPES
def test_the_same_split_or_batched(triton: bool, dtype: torch.dtype) -> None:
    """Our 17 rows alone in one call, against the same rows cut into chunks of 1, 1, 4 and
    11, each chunk batched with other sequences: equal bits however the rows come."""
    scan, params = _scan(triton), _params(dtype)
    rows = _rows(17, dtype)
    alone_state = _state()
    state = alone_state.clone()
    alone = scan(*scan_inputs(rows, params), alone_state, *_batch((17,), (2,), (False,)))
    outs, start = [], 0
    for part, cut in enumerate((1, 1, 4, 11)):
        lengths, slots, index = _in_company(part, cut)
        others = [_rows(length, dtype, seed=20 + i) for i, length in enumerate(lengths)]
        others[index] = take(rows, start, start + cut)
        batch = _batch(lengths, slots, [slot != 2 or part > 0 for slot in slots])
        out = scan(*scan_inputs(cat(others), params), state, *batch)
        first = sum(lengths[:index])
        outs.append(out[first : first + cut])
        start += cut
    assert torch.equal(torch.cat(outs), alone)
    assert torch.equal(state[2], alone_state[2])


@IMPLEMENTATIONS
def test_a_first_chunk_ignores_what_its_slot_held(triton: bool) -> None:
    """has_state=False: a slot full of NaN gives the bits of a slot of zeros."""
    batch, rows, params = _batch((5,), (1,), (False,)), _rows(5, torch.float32), _params()
    results = []
    for fill in (float("nan"), 0.0):
        state = torch.full((NUM_SLOTS, HEADS, HEAD_DIM, STATE_SIZE), fill)
        results.append((_scan(triton)(*scan_inputs(rows, params), state, *batch), state[1]))
    for garbage, zeros in zip(*results, strict=True):
        assert torch.equal(garbage, zeros)
    assert not results[0][0].isnan().any()


def _arguments() -> dict[str, Any]:
    rows = dict(zip(("x", "dt", "B", "C"), _rows(6, torch.float32), strict=True))
    params = dict(zip(("A", "D", "dt_bias"), _params(), strict=True))
    sequences = dict(zip(("query_start", "slots", "has_state"), _batch((1, 5), (0, 1), (True, False)), strict=True))
    return dict(**rows, **params, state=_state(), **sequences)


MISTAKES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "x": lambda a: a["x"][0],  # 2 dimensions
    "dt": lambda a: a["dt"].bfloat16(),  # not x's dtype
    "A": lambda a: a["A"].bfloat16(),  # not float32
    "B": lambda a: torch.cat([a["B"], a["B"][:, :1]], dim=1),  # 3 groups for 4 heads
    "C": lambda a: a["C"][:, :, :-1],  # state size differs from B's
    "D": lambda a: a["D"][:-1],
    "dt_bias": lambda a: a["dt_bias"].long(),
    "state": lambda a: a["state"][:, :2],  # 2 heads for 4
    "query_start": lambda a: a["query_start"][:-1],
    "slots": lambda a: a["slots"].float(),
    "dt_limit": lambda a: (1.0, 0.0),
}


@IMPLEMENTATIONS
@pytest.mark.parametrize("name", [*MISTAKES, "state dtype"])
def test_rejects_bad_arguments(triton: bool, name: str) -> None:
    arguments = _arguments()
    if name == "state dtype":
        arguments["state"], name = arguments["state"].bfloat16(), "state"
    else:
        arguments[name] = MISTAKES[name](arguments)
    with pytest.raises(KernelArgumentError, match=f"^{name}:"):
        _scan(triton)(**arguments)
