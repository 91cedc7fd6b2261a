"""The chunked gated delta rule against transformers' two torch forms, the recurrent
kernels, and itself cut and batched in different ways.

The torch reference is close to transformers' chunked form (the same chunks) for sequences
from position 0, and to the recurrent form for any lengths and starts; its rows outside
whole chunks are the recurrent form's bits. The Triton kernel (interpreted) agrees with
the reference to float32 rounding, bfloat16 inputs to bfloat16 rounding. Both give a
sequence the same bits alone or batched and whether its calls were cut at multiples of
the chunk size or not at all; a call starting off alignment is the same as that call cut
at its first chunk boundary. Sizes are small and not powers of two (key dim 12 in a tile of
16, value dim 20 in two tiles of 16, chunks of 8 padded to 16), so every mask runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from pagefleet.kernels.checks import KernelArgumentError
from pagefleet.kernels.chunked_gated_delta_rule import chunked_gated_delta_rule, chunked_gated_delta_rule_torch
from pagefleet.kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_torch
from tests.kernels.state_inputs import cat, chunked_batch, gated_delta_rows, starts, take

KEY_HEADS, HEADS, KEY_DIM, VALUE_DIM = 2, 4, 12, 20
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

Rows = tuple[torch.Tensor, ...]  # (query, key, value, g, beta), each [T, ...]


def _rows(num_rows: int, dtype: torch.dtype, seed: int = 1) -> Rows:
    return gated_delta_rows(num_rows, (KEY_HEADS, HEADS), (KEY_DIM, VALUE_DIM), dtype, seed)


def _state(seed: int = 2) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(seed))


def _chunked(triton: bool) -> Callable[..., torch.Tensor]:
    return chunked_gated_delta_rule if triton else chunked_gated_delta_rule_torch


def _packed(rows: Rows) -> Rows:
    """query, key, value as views into one [T, q | k | v] projection, as the model passes them."""
    query, key, value, g, beta = rows
    packed = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    q, k, v = packed.split([query[0].numel(), key[0].numel(), value[0].numel()], dim=1)
    return q.view(query.shape), k.view(key.shape), v.view(value.shape), g, beta


@CHUNK_SIZES
def test_reference_is_close_to_transformers_chunked_form(chunk_size: int) -> None:
    """Prompts of 16 and 32 rows from zeros at position 0 in one call (their slots hold
    garbage), each against `torch_chunk_gated_delta_rule` with the same chunk size: the same
    chunks, their triangular solve by `solve_triangular` and ours by substitution."""
    lengths, slots = (16, 32), (3, 0)
    rows, state = _rows(sum(lengths), torch.float32), _state()
    out = chunked_gated_delta_rule_torch(
        *rows, state, *chunked_batch(lengths, slots, (False, False), (0, 0)), chunk_size=chunk_size
    )
    for (start, end), slot in zip(starts(lengths), slots, strict=True):
        theirs, theirs_state = torch_chunk_gated_delta_rule(
            *(tensor[None] for tensor in take(rows, start, end)),
            chunk_size=chunk_size,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[start:end], theirs[0], **TOLERANCE[torch.float32])
        torch.testing.assert_close(state[slot], theirs_state[0], **TOLERANCE[torch.float32])


def test_reference_is_close_to_the_recurrent_form() -> None:
    """Lengths 1, 5, 17 and 40 at positions 3, 0, 12 and 0, mixed has_state, chunks of 8:
    single rows, whole chunks and partial ones, against `gated_delta_rule_torch`."""
    lengths, slots, has_state, positions = (1, 5, 17, 40), (3, 0, 5, 1), (True, False, True, False), (3, 0, 12, 0)
    rows, before = _rows(sum(lengths), torch.float32), _state()
    expected_state, state = before.clone(), before.clone()
    expected = gated_delta_rule_torch(*rows, expected_state, *chunked_batch(lengths, slots, has_state, positions)[:3])
    out = chunked_gated_delta_rule_torch(
        *rows, state, *chunked_batch(lengths, slots, has_state, positions), chunk_size=CHUNK
    )
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
    torch.testing.assert_close(state, expected_state, **TOLERANCE[torch.float32])


def test_rows_outside_whole_chunks_are_the_recurrent_forms_bits() -> None:
    """5 rows at positions 3..7 (no whole chunk of 8) from a stored state: the recurrent
    reference's row step, bit for bit."""
    rows, before = _rows(5, torch.float32), _state()
    expected_state, state = before.clone(), before.clone()
    expected = gated_delta_rule_torch(*rows, expected_state, *chunked_batch((5,), (4,), (True,), (3,))[:3])
    out = chunked_gated_delta_rule_torch(*rows, state, *chunked_batch((5,), (4,), (True,), (3,)), chunk_size=CHUNK)
    assert torch.equal(out, expected)
    assert torch.equal(state, expected_state)


@DTYPES
@CHUNK_SIZES
@pytest.mark.triton
def test_triton_matches_the_reference(dtype: torch.dtype, chunk_size: int) -> None:
    """Lengths 1, 5, 0, 17 and 40 at positions 7, 0, 4, 12 and 0, mixed has_state, Dv in two
    tiles, q/k/v views into one projection. The state is float32 from the same inputs
    whatever their dtype, so it is compared at float32's tolerance. Chunks in the wrong place
    would pass here too (both forms agree to rounding): the bit-for-bit tests below see them."""
    lengths, slots, positions = (1, 5, 0, 17, 40), (3, 0, 6, 5, 1), (7, 0, 4, 12, 0)
    rows, before = _packed(_rows(sum(lengths), dtype)), _state()
    batch = chunked_batch(lengths, slots, (True, False, True, True, False), positions)
    expected_state, state = before.clone(), before.clone()
    expected = chunked_gated_delta_rule_torch(*rows, expected_state, *batch, chunk_size=chunk_size)
    out = chunked_gated_delta_rule(*rows, state, *batch, chunk_size=chunk_size, block_v=16)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, expected_state, **TOLERANCE[torch.float32])
    assert torch.equal(state[6], before[6]), "a sequence without rows changed its state"
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in slots]
    assert torch.equal(state[untouched], before[untouched])


# Our 37 rows (slot 2, from zeros) in calls of these lengths: one call; cuts at multiples of
# 8 with a partial chunk last; a prompt of 35 rows (cut at 32) then two decode rows.
CUTS = pytest.mark.parametrize("cuts", [(37,), (16, 8, 13), (32, 3, 1, 1)], ids=["whole", "aligned", "decode"])


def _in_company(part: int, cut: int, position: int) -> tuple[Rows, int]:
    """(the batch, index of ours): our cut at `position` among two other sequences, at
    another place in each call; theirs start off alignment (a chunk and partial rows)."""
    others = [(3, 0, 5), (13, 4, 6)]  # (length, slot, start position)
    others.insert(part % 3, (cut, 2, position))
    lengths, slots, positions = zip(*others, strict=True)
    return chunked_batch(lengths, slots, [slot != 2 or part > 0 for slot in slots], positions), part % 3


@IMPLEMENTATIONS
@CUTS
def test_the_same_bits_alone_split_or_batched(triton: bool, cuts: tuple[int, ...]) -> None:
    """The path invariance the alignment rule exists for: our sequence alone in one call,
    against its rows cut into calls at multiples of the chunk size, each among others."""
    chunked = _chunked(triton)
    rows = _rows(37, torch.float32)
    alone_state = _state()
    state = alone_state.clone()
    alone = chunked(*rows, alone_state, *chunked_batch((37,), (2,), (False,), (0,)), chunk_size=CHUNK)
    outs, start = [], 0
    for part, cut in enumerate(cuts):
        batch, index = _in_company(part, cut, start)
        lengths = (batch[0][1:] - batch[0][:-1]).tolist()
        parts = [_rows(length, torch.float32, seed=20 + i) for i, length in enumerate(lengths)]
        parts[index] = take(rows, start, start + cut)
        out = chunked(*cat(parts), state, *batch, chunk_size=CHUNK)
        outs.append(out[sum(lengths[:index]) :][:cut])
        start += cut
    assert torch.equal(torch.cat(outs), alone)
    assert torch.equal(state[2], alone_state[2])


@IMPLEMENTATIONS
def test_an_unaligned_call_is_cut_at_its_first_boundary(triton: bool) -> None:
    """Resuming at position 12 with chunks of 8: rows 12..31 in one call give the bits of
    rows 12..15 (recurrent: the recurrent kernel's bits) then 16..31 (two chunks), and are
    close to the 32 rows in one call, whose rows 8..15 were a chunk."""
    chunked = _chunked(triton)
    recurrent = gated_delta_rule if triton else gated_delta_rule_torch
    tile = dict(block_v=32) if triton else {}  # the recurrent kernel's tile for 20 columns: its exact ops
    rows, states = _rows(32, torch.float32), [_state() for _ in range(4)]
    whole = chunked(*rows, states[0], *chunked_batch((32,), (1,), (False,), (0,)), chunk_size=CHUNK)
    for state in states[1:]:
        chunked(*take(rows, 0, 12), state, *chunked_batch((12,), (1,), (False,), (0,)), chunk_size=CHUNK)
    resumed = chunked(
        *take(rows, 12, 32), states[1], *chunked_batch((20,), (1,), (True,), (12,)), chunk_size=CHUNK, **tile
    )
    head = chunked(*take(rows, 12, 16), states[2], *chunked_batch((4,), (1,), (True,), (12,)), chunk_size=CHUNK, **tile)
    tail = chunked(
        *take(rows, 16, 32), states[2], *chunked_batch((16,), (1,), (True,), (16,)), chunk_size=CHUNK, **tile
    )
    assert torch.equal(resumed, torch.cat([head, tail]))
    assert torch.equal(states[1][1], states[2][1])
    assert torch.equal(head, recurrent(*take(rows, 12, 16), states[3], *chunked_batch((4,), (1,), (True,), (12,))[:3]))
    torch.testing.assert_close(resumed, whole[12:], **TOLERANCE[torch.float32])
    torch.testing.assert_close(states[1][1], states[0][1], **TOLERANCE[torch.float32])


@IMPLEMENTATIONS
def test_a_first_chunk_ignores_what_its_slot_held(triton: bool) -> None:
    """has_state=False: a slot full of NaN gives the bits of a slot of zeros (a chunk of 8
    and 5 rows after it)."""
    batch, rows = chunked_batch((13,), (1,), (False,), (0,)), _rows(13, torch.float32)
    results = []
    for fill in (float("nan"), 0.0):
        state = torch.full((NUM_SLOTS, HEADS, KEY_DIM, VALUE_DIM), fill)
        results.append((_chunked(triton)(*rows, state, *batch, chunk_size=CHUNK), state[1]))
    for garbage, zeros in zip(*results, strict=True):
        assert torch.equal(garbage, zeros)


def _arguments() -> dict[str, Any]:
    rows = dict(zip(("query", "key", "value", "g", "beta"), _rows(6, torch.float32), strict=True))
    names = ("query_start", "slots", "has_state", "start_positions")
    batch = dict(zip(names, chunked_batch((1, 5), (0, 1), (True, False), (3, 0)), strict=True))
    return dict(**rows, state=_state(), **batch, chunk_size=CHUNK)


MISTAKES: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    "query": ("query", lambda a: a["query"][0]),  # 2 dimensions
    "state": ("state", lambda a: a["state"].bfloat16()),  # not float32
    "has_state": ("has_state", lambda a: a["has_state"].int()),
    "positions_shape": ("start_positions", lambda a: a["start_positions"][:1]),
    "positions_dtype": ("start_positions", lambda a: a["start_positions"].float()),
    "positions_device": ("start_positions", lambda a: a["start_positions"].to("meta")),
    "chunk_not_power_of_two": ("chunk_size", lambda a: 12),
    "chunk_zero": ("chunk_size", lambda a: 0),
    "chunk_float": ("chunk_size", lambda a: 8.0),
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
    chunked = _chunked(triton)
    tile = dict(block_v=32) if triton else {}
    rows, states = _rows(34, torch.float32), [_state() for _ in range(2)]
    limits = torch.tensor([24])
    whole = chunked(*rows, states[0], *chunked_batch((34,), (1,), (False,), (0,)), limits, chunk_size=CHUNK, **tile)
    parts = [
        chunked(*take(rows, 0, 24), states[1], *chunked_batch((24,), (1,), (False,), (0,)), chunk_size=CHUNK, **tile)
    ]
    for row in range(24, 34):
        parts.append(
            chunked(
                *take(rows, row, row + 1),
                states[1],
                *chunked_batch((1,), (1,), (True,), (row,)),
                chunk_size=CHUNK,
                **tile,
            )
        )
    assert torch.equal(whole, torch.cat(parts))
    assert torch.equal(states[0][1], states[1][1])
    unlimited = chunked(*rows, _state(), *chunked_batch((34,), (1,), (False,), (0,)), chunk_size=CHUNK, **tile)
    assert not torch.equal(unlimited[24:], whole[24:]), "without the limit rows 24..31 are a chunk"
