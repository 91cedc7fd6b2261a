"""The compiled state-layer operators (kernels/cpu_state.py, csrc/cpu_state.cpp) against their
torch references, and against themselves however a batch is cut.

Each op agrees with its reference to float32 rounding, bfloat16 outputs to bfloat16 rounding,
on a batch mixing first chunks and continuations (lengths 1, 5, 0 and 17); the conv's window
holds copies of inputs, so its state is equal bit for bit. A sequence's outputs and final
state are the same bits in one call, split across calls beside other sequences, or alone; a
first chunk ignores what its slot held; slots outside the batch keep their bits. Sizes are
not powers of two, so every partial block runs: 70 channels in blocks of 64 (the conv's
state a channels-last buffer viewed as [S, C, K-1]), 45 value columns in tiles of 32 (the
delta rule), 20 state rows in tiles of 16 and a state of 36 (the scan).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagefleet.kernels import cpu_ops
from pagefleet.kernels.causal_conv1d import causal_conv1d_torch
from pagefleet.kernels.checks import KernelArgumentError
from pagefleet.kernels.cpu_state import causal_conv1d_cpu, gated_delta_rule_cpu, selective_scan_cpu
from pagefleet.kernels.gated_delta_rule import gated_delta_rule_torch
from pagefleet.kernels.selective_scan import selective_scan_torch
from tests.kernels.state_inputs import gated_delta_rows

pytestmark = pytest.mark.skipif(
    not cpu_ops.load(),
    reason="the compiled CPU operators are unavailable (no g++/ninja, or PAGEFLEET_DISABLE_CPU_OPS=1)",
)

NUM_SLOTS = 7
CHANNELS, TAPS = 70, 4
KEY_HEADS, HEADS, KEY_DIM, VALUE_DIM = 2, 4, 12, 45
SCAN_HEADS, GROUPS, HEAD_DIM, STATE_SIZE = 4, 2, 20, 36
TOLERANCE: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}

Tensors = tuple[torch.Tensor, ...]


def _batch(lengths: Sequence[int], slots: Sequence[int], has_state: Sequence[bool]) -> Tensors:
    """(query_start int32 [N + 1], slots int64 [N], has_state bool [N])."""
    query_start = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return query_start, torch.tensor(slots, dtype=torch.int64), torch.tensor(has_state)


def _conv_rows(num_rows: int, dtype: torch.dtype, seed: int) -> Tensors:
    return (torch.randn(num_rows, CHANNELS, generator=torch.Generator().manual_seed(seed)).to(dtype),)


def _conv_params(dtype: torch.dtype) -> Tensors:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(CHANNELS, TAPS, generator=generator) * 0.5).to(dtype)
    return weight, torch.randn(CHANNELS, generator=generator).to(dtype)


def _conv_state(dtype: torch.dtype) -> torch.Tensor:
    """A channels-last buffer [S, K-1, C], viewed as [S, C, K-1] (any strides work)."""
    buffer = torch.randn(NUM_SLOTS, TAPS - 1, CHANNELS, generator=torch.Generator().manual_seed(2))
    return buffer.to(dtype).transpose(1, 2)


def _rule_rows(num_rows: int, dtype: torch.dtype, seed: int) -> Tensors:
    return gated_delta_rows(num_rows, (KEY_HEADS, HEADS), (KEY_DIM, VALUE_DIM), dtype, seed)


def _rule_state(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(NUM_SLOTS, HEADS, KEY_DIM, VALUE_DIM, generator=generator)


def _scan_rows(num_rows: int, dtype: torch.dtype, seed: int) -> Tensors:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, SCAN_HEADS, HEAD_DIM, generator=generator).to(dtype)
    dt = torch.randn(num_rows, SCAN_HEADS, generator=generator).to(dtype)
    B, C = (torch.randn(num_rows, GROUPS, STATE_SIZE, generator=generator).to(dtype) for _ in range(2))
    return x, dt, B, C


def _scan_params(dtype: torch.dtype) -> Tensors:
    """(A float32, D, dt_bias): softplus(dt + dt_bias) near 0.13, as trained models'."""
    generator = torch.Generator().manual_seed(0)
    A = -torch.exp(torch.randn(SCAN_HEADS, generator=generator) * 0.5)
    D = torch.randn(SCAN_HEADS, generator=generator).to(dtype)
    return A, D, (torch.randn(SCAN_HEADS, generator=generator) * 0.5 - 2.0).to(dtype)


def _scan_state(dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2)
    return torch.randn(NUM_SLOTS, SCAN_HEADS, HEAD_DIM, STATE_SIZE, generator=generator)


@dataclass(frozen=True)
class Op:
    """One operator and its reference, with its inputs: rows (each [T, ...]), parameters and
    state, and how the op takes them."""

    compiled: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    rows: Callable[[int, torch.dtype, int], Tensors]
    params: Callable[[torch.dtype], Tensors]
    state: Callable[[torch.dtype], torch.Tensor]
    call: Callable[..., torch.Tensor]  # (fn, rows, params, state, batch) -> out


OPS = {
    "conv": Op(
        causal_conv1d_cpu,
        causal_conv1d_torch,
        _conv_rows,
        _conv_params,
        _conv_state,
        lambda fn, rows, params, state, batch: fn(rows[0], *params, state, *batch, activation="silu"),
    ),
    "delta_rule": Op(
        gated_delta_rule_cpu,
        gated_delta_rule_torch,
        _rule_rows,
        lambda dtype: (),
        _rule_state,
        lambda fn, rows, params, state, batch: fn(*rows, state, *batch),
    ),
    "scan": Op(
        selective_scan_cpu,
        selective_scan_torch,
        _scan_rows,
        _scan_params,
        _scan_state,
        lambda fn, rows, params, state, batch: fn(
            rows[0], rows[1], params[0], rows[2], rows[3], params[1], params[2], state, *batch
        ),
    ),
}
OP_NAMES = pytest.mark.parametrize("name", list(OPS))
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _take(rows: Tensors, start: int, end: int) -> Tensors:
    return tuple(tensor[start:end] for tensor in rows)


def _cat(parts: Sequence[Tensors]) -> Tensors:
    return tuple(torch.cat(tensors) for tensors in zip(*parts, strict=True))


def _packed(rows: Tensors) -> Tensors:
    """The rows in the first's dtype as views into one [T, widths + 3] tensor, rows strided by
    its width, as a layer's projection gives them (g, float32, stays apart)."""
    dtype = rows[0].dtype
    widths = [tensor[0].numel() for tensor in rows if tensor.dtype == dtype]
    padding = torch.zeros(rows[0].shape[0], 3, dtype=dtype)
    packed = torch.cat([*(tensor.flatten(1) for tensor in rows if tensor.dtype == dtype), padding], dim=1)
    views = iter(packed.split([*widths, 3], dim=1))
    return tuple(next(views).view(tensor.shape) if tensor.dtype == dtype else tensor for tensor in rows)


@OP_NAMES
@DTYPES
def test_the_op_matches_its_reference(name: str, dtype: torch.dtype) -> None:
    """Lengths 1, 5, 0 (a sequence without rows keeps its state) and 17, first chunks and
    continuations mixed, the rows strided views. The states are float32 from the same inputs
    whatever their dtype (the conv's: copies of inputs, equal bits)."""
    op = OPS[name]
    lengths, slots = (1, 5, 0, 17), (3, 0, 6, 5)
    batch = _batch(lengths, slots, (True, False, True, True))
    rows, params, before = _packed(op.rows(sum(lengths), dtype, 1)), op.params(dtype), op.state(dtype)
    expected_state, state = before.clone(), before.clone()
    expected = op.call(op.reference, rows, params, expected_state, batch)
    out = op.call(op.compiled, rows, params, state, batch)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    if name == "conv":
        assert torch.equal(state, expected_state)
    else:
        torch.testing.assert_close(state, expected_state, **TOLERANCE[torch.float32])
    assert torch.equal(state[6], before[6]), "a sequence without rows changed its state"
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in slots]
    assert torch.equal(state[untouched], before[untouched]), "a slot outside the batch changed"


def _in_company(part: int, cut: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(lengths, slots, index of ours): chunk `part` of our sequence (slot 2) among others,
    at a different place in each call."""
    lengths, slots = [3, 2], [0, 4]
    index = part % 3
    lengths.insert(index, cut)
    slots.insert(index, 2)
    return tuple(lengths), tuple(slots), index


@OP_NAMES
@pytest.mark.parametrize("cuts", [(1, 1, 4, 11), (9, 8)], ids=["four_calls", "two_calls"])
def test_a_sequence_is_the_same_bits_alone_or_split_and_batched(name: str, cuts: tuple[int, ...]) -> None:
    """Our 17 rows alone in one call, against the same rows cut into chunks (1-row chunks
    shift the conv's window by less than its width), each chunk beside other sequences."""
    op = OPS[name]
    rows, params = op.rows(17, torch.float32, 1), op.params(torch.float32)
    alone_state = op.state(torch.float32)
    state = alone_state.clone()
    alone = op.call(op.compiled, rows, params, alone_state, _batch((17,), (2,), (False,)))
    outs, start = [], 0
    for part, cut in enumerate(cuts):
        lengths, slots, index = _in_company(part, cut)
        others = [op.rows(length, torch.float32, 20 + i) for i, length in enumerate(lengths)]
        others[index] = _take(rows, start, start + cut)
        batch = _batch(lengths, slots, [slot != 2 or part > 0 for slot in slots])
        out = op.call(op.compiled, _cat(others), params, state, batch)
        first = sum(lengths[:index])
        outs.append(out[first : first + cut])
        start += cut
    assert torch.equal(torch.cat(outs), alone)
    assert torch.equal(state[2], alone_state[2])


@OP_NAMES
def test_a_batch_is_the_same_bits_as_each_sequence_alone(name: str) -> None:
    """Three sequences of 5, 1 and 17 rows from stored states in one call, against each in a
    call of its own (the threads split the batch's items otherwise)."""
    op = OPS[name]
    lengths, slots = (5, 1, 17), (1, 5, 3)
    rows, params = op.rows(sum(lengths), torch.float32, 1), op.params(torch.float32)
    batched_state = op.state(torch.float32)
    alone_state = batched_state.clone()
    batched = op.call(op.compiled, rows, params, batched_state, _batch(lengths, slots, (True,) * 3))
    bounds = (0, *itertools.accumulate(lengths))
    for (start, end), slot in zip(itertools.pairwise(bounds), slots, strict=True):
        alone = op.call(
            op.compiled, _take(rows, start, end), params, alone_state, _batch((end - start,), (slot,), (True,))
        )
        assert torch.equal(batched[start:end], alone)
    assert torch.equal(batched_state, alone_state)


@OP_NAMES
def test_a_first_chunk_ignores_what_its_slot_held(name: str) -> None:
    """has_state=False: a slot full of NaN gives the bits of a slot of zeros."""
    op = OPS[name]
    rows, params, batch = op.rows(5, torch.float32, 1), op.params(torch.float32), _batch((5,), (1,), (False,))
    results = []
    for fill in (float("nan"), 0.0):
        state = op.state(torch.float32).fill_(fill)
        results.append((op.call(op.compiled, rows, params, state, batch), state[1]))
    (garbage, garbage_state), (zeros, zeros_state) = results
    assert torch.equal(garbage, zeros)
    assert torch.equal(garbage_state, zeros_state)


@OP_NAMES
def test_float16_takes_the_reference(name: str) -> None:
    """The operators take float32 and bfloat16; a float16 call is the reference's, bit for bit."""
    op = OPS[name]
    rows, params, batch = op.rows(6, torch.float16, 1), op.params(torch.float16), _batch((1, 5), (0, 1), (True, False))
    expected_state, state = op.state(torch.float16), op.state(torch.float16)
    expected = op.call(op.reference, rows, params, expected_state, batch)
    assert torch.equal(op.call(op.compiled, rows, params, state, batch), expected)
    assert torch.equal(state, expected_state)


@OP_NAMES
def test_bad_arguments_are_refused_before_the_op(name: str) -> None:
    """The reference's checks run first: state slots of the wrong shape."""
    op = OPS[name]
    rows, params, batch = op.rows(6, torch.float32, 1), op.params(torch.float32), _batch((1, 5), (0, 1), (True, False))
    with pytest.raises(KernelArgumentError, match="state"):
        op.call(op.compiled, rows, params, op.state(torch.float32)[:, :1], batch)


@OP_NAMES
def test_two_threads_give_the_bits_of_one(name: str) -> None:
    """A batch big enough to be spread over threads (its items split between them otherwise
    than on one thread) gives the same bits."""
    op = OPS[name]
    lengths, slots = (400, 3, 200), (1, 5, 3)
    rows, params, batch = (
        op.rows(sum(lengths), torch.float32, 1),
        op.params(torch.float32),
        _batch(lengths, slots, (True, False, True)),
    )
    results = []
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            state = op.state(torch.float32)
            results.append((op.call(op.compiled, rows, params, state, batch), state))
    finally:
        torch.set_num_threads(threads)
    (one, one_state), (two, two_state) = results
    assert torch.equal(one, two)
    assert torch.equal(one_state, two_state)
