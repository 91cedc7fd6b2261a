"""The linear-attention kernels (causal conv1d, gated delta rule) against transformers and
against each other, on flat batches of sequences that each own a state slot.

The torch references equal transformers' own torch functions (Qwen3-Next's) bit for bit in
float32, for a batch of prefills from zeros and for the decode steps that continue from their
states; the recurrent rule is also close to transformers' chunked form. The Triton kernels
(interpreted) agree with the references to float32 rounding, and bfloat16 inputs to bfloat16
rounding. Both implementations give a sequence the same bits whether its rows come in one
call or split across calls, alone or among other sequences; a first chunk ignores what its
slot held; slots outside the batch keep their bits. Sizes are small and not all powers of
two (24 channels in blocks of 16, 3 taps in a block of 4), so every mask runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next.modeling_qwen3_next import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from pagefleet.kernels.causal_conv1d import causal_conv1d, causal_conv1d_torch
from pagefleet.kernels.checks import KernelArgumentError
from pagefleet.kernels.gated_delta_rule import gated_delta_rule, gated_delta_rule_torch
from tests.kernels.state_inputs import gated_delta_rows

CHANNELS, TAPS = 24, 4
KEY_HEADS, HEADS, HEAD_DIM = 2, 4, 16
NUM_SLOTS = 7
LENGTHS = (1, 5, 17)
TOLERANCE: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
IMPLEMENTATIONS = pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])

Rows = tuple[torch.Tensor, ...]  # (query, key, value, g, beta), each [T, ...]


def _batch(lengths: Sequence[int], slots: Sequence[int], has_state: Sequence[bool]) -> Rows:
    """(query_start int32 [N + 1], slots int64 [N], has_state bool [N])."""
    query_start = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return query_start, torch.tensor(slots, dtype=torch.int64), torch.tensor(has_state)


def _conv(triton: bool) -> Callable[..., torch.Tensor]:
    return causal_conv1d if triton else causal_conv1d_torch


def _conv_weights(taps: int, dtype: torch.dtype, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(CHANNELS, taps, generator=generator) * 0.5).to(dtype)
    return weight, (torch.randn(CHANNELS, generator=generator).to(dtype) if bias else None)


def _conv_rows(num_rows: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(num_rows, CHANNELS, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _gdn_rows(num_rows: int, dtype: torch.dtype, seed: int = 1) -> Rows:
    return gated_delta_rows(num_rows, (KEY_HEADS, HEADS), (HEAD_DIM, HEAD_DIM), dtype, seed)


def _gdn_state(seed: int = 2) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, HEADS, HEAD_DIM, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def _gdn(triton: bool) -> Callable[..., torch.Tensor]:
    return gated_delta_rule if triton else gated_delta_rule_torch


def _take(rows: Rows, start: int, end: int) -> Rows:
    return tuple(tensor[start:end] for tensor in rows)


def _cat(parts: Sequence[Rows]) -> Rows:
    return tuple(torch.cat(tensors) for tensors in zip(*parts, strict=True))


def _packed(rows: Rows) -> Rows:
    """query, key, value as the model passes them: views into one [T, q | k | v] projection,
    rows strided by its width."""
    query, key, value, g, beta = rows
    packed = torch.cat([query.flatten(1), key.flatten(1), value.flatten(1)], dim=1)
    q, k, v = packed.split([query[0].numel(), key[0].numel(), value[0].numel()], dim=1)
    return q.view(query.shape), k.view(key.shape), v.view(value.shape), g, beta


def _silu_alone(y: torch.Tensor) -> torch.Tensor:
    """F.silu of each element in a call of its own: torch's scalar loop, never its vector exp."""
    return torch.stack([F.silu(element) for element in y.flatten()]).view(y.shape)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_conv_reference_equals_transformers(bias: bool, activation: str | None) -> None:
    """Three prefills from zeros in one batch (slots holding garbage), then three decode
    steps of all three at once, each sequence against transformers' own two paths. Their
    cache keeps K inputs (ours K-1: the oldest of theirs reaches no output they keep). Where
    their prefill rounds by its row count (see causal_conv1d's docstring), within an ulp, and
    equal to their decode step from zeros (one row) or their convolution with each silu
    taken alone (16 rows or more)."""
    weight, conv_bias = _conv_weights(TAPS, torch.float32, bias)
    x = _conv_rows(sum(LENGTHS), torch.float32)
    conv_state = torch.randn(NUM_SLOTS, CHANNELS, TAPS - 1)
    slots = (3, 0, 5)
    out = causal_conv1d_torch(x, weight, conv_bias, conv_state, *_batch(LENGTHS, slots, (False,) * 3), activation)
    theirs_states = []
    for (start, end), slot in zip(itertools.pairwise((0, *itertools.accumulate(LENGTHS))), slots, strict=True):
        prompt = x[start:end].T[None]
        theirs = causal_conv1d_fn(prompt, weight, conv_bias, activation)[0].T
        torch.testing.assert_close(out[start:end], theirs, rtol=2.5e-7, atol=1e-7)  # an ulp at most
        if end - start == 1:  # their one-row prefill convolves by another algorithm: as their decode step
            zeros = torch.zeros(1, CHANNELS, TAPS)
            theirs = causal_conv1d_update(prompt, zeros, weight, conv_bias, activation)[0].T
        elif activation is not None and end - start >= 16:  # their silu's vector loop on the first rows
            theirs = _silu_alone(causal_conv1d_fn(prompt, weight, conv_bias, None)[0].T)
        assert torch.equal(out[start:end], theirs)
        theirs_states.append(F.pad(prompt, (max(TAPS - prompt.shape[-1], 0), 0))[:, :, -TAPS:])  # as their cache
        assert torch.equal(conv_state[slot], theirs_states[-1][0, :, 1:])
    for step in range(3):
        tokens = _conv_rows(3, torch.float32, seed=10 + step)
        batch = _batch((1, 1, 1), slots, (True,) * 3)
        out = causal_conv1d_torch(tokens, weight, conv_bias, conv_state, *batch, activation)
        for sequence, slot in enumerate(slots):
            token = tokens[sequence, :, None][None]
            theirs = causal_conv1d_update(token, theirs_states[sequence], weight, conv_bias, activation)
            assert torch.equal(out[sequence], theirs[0, :, 0])
            assert torch.equal(conv_state[slot], theirs_states[sequence][0, :, 1:])


def test_gdn_reference_equals_transformers() -> None:
    """As above for the recurrent rule: prefills of 1, 5 and 17 rows from zeros in one batch,
    then three batched decode steps, against `torch_recurrent_gated_delta_rule` per sequence."""
    rows, state, slots = _gdn_rows(sum(LENGTHS), torch.float32), _gdn_state(), (3, 0, 5)
    out = gated_delta_rule_torch(*rows, state, *_batch(LENGTHS, slots, (False,) * 3))
    theirs_states = []
    for (start, end), slot in zip(itertools.pairwise((0, *itertools.accumulate(LENGTHS))), slots, strict=True):
        prompt = tuple(tensor[None] for tensor in _take(rows, start, end))
        theirs, theirs_state = torch_recurrent_gated_delta_rule(
            *prompt, output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        assert torch.equal(out[start:end], theirs[0])
        assert torch.equal(state[slot], theirs_state[0])
        theirs_states.append(theirs_state)
    for step in range(3):
        tokens = _gdn_rows(3, torch.float32, seed=10 + step)
        out = gated_delta_rule_torch(*tokens, state, *_batch((1, 1, 1), slots, (True,) * 3))
        for sequence, slot in enumerate(slots):
            token = tuple(tensor[None, sequence : sequence + 1] for tensor in tokens)
            theirs, theirs_states[sequence] = torch_recurrent_gated_delta_rule(
                *token, initial_state=theirs_states[sequence], output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            assert torch.equal(out[sequence], theirs[0, 0])
            assert torch.equal(state[slot], theirs_states[sequence][0])


def test_gdn_reference_is_close_to_the_chunked_form() -> None:
    """17 rows from a stored state, against transformers' chunked form in chunks of 8 (so
    the state crosses two chunk boundaries): another order of the same sums."""
    rows, state = _gdn_rows(17, torch.float32), _gdn_state()
    initial = state[4:5].clone()
    out = gated_delta_rule_torch(*rows, state, *_batch((17,), (4,), (True,)))
    theirs, theirs_state = torch_chunk_gated_delta_rule(
        *(tensor[None] for tensor in rows),
        chunk_size=8,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(out, theirs[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[4], theirs_state[0], rtol=1e-4, atol=1e-5)


@DTYPES
@pytest.mark.parametrize("taps", [3, TAPS])
def test_conv_triton_matches_the_reference(dtype: torch.dtype, taps: int) -> None:
    """Lengths 1, 5, 0 (a sequence with no row keeps its window) and 17; mixed has_state;
    two blocks of 16 channels for 24; x a view with strided rows, as the model's projection
    gives it. The state holds copies of inputs: equal bits."""
    weight, bias = _conv_weights(taps, dtype)
    lengths, slots = (1, 5, 0, 17), (3, 0, 6, 5)
    x = torch.cat([_conv_rows(sum(lengths), dtype), _conv_rows(sum(lengths), dtype, seed=9)], dim=1)[:, :CHANNELS]
    before = torch.randn(NUM_SLOTS, CHANNELS, taps - 1).to(dtype)
    batch = _batch(lengths, slots, (True, False, True, True))
    expected_state, state = before.clone(), before.clone()
    expected = causal_conv1d_torch(x, weight, bias, expected_state, *batch)
    out = causal_conv1d(x, weight, bias, state, *batch, block_channels=16)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    assert torch.equal(state, expected_state)
    assert torch.equal(state[6], before[6]), "a sequence without rows changed its window"
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in slots]
    assert torch.equal(state[untouched], before[untouched])


@DTYPES
def test_gdn_triton_matches_the_reference(dtype: torch.dtype) -> None:
    """Lengths 1, 5, 0 and 17, mixed has_state, Dv in two tiles of 8, q/k/v views into one
    projection. The state is float32 from the same inputs whatever their dtype, so it is
    compared at float32's tolerance."""
    lengths, slots = (1, 5, 0, 17), (3, 0, 6, 5)
    rows, before = _packed(_gdn_rows(sum(lengths), dtype)), _gdn_state()
    batch = _batch(lengths, slots, (True, False, True, True))
    expected_state, state = before.clone(), before.clone()
    expected = gated_delta_rule_torch(*rows, expected_state, *batch)
    out = gated_delta_rule(*rows, state, *batch, block_v=8)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(state, expected_state, **TOLERANCE[torch.float32])
    assert torch.equal(state[6], before[6]), "a sequence without rows changed its state"
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in slots]
    assert torch.equal(state[untouched], before[untouched])


CUTS = pytest.mark.parametrize("cuts", [(17,), (1, 1, 4, 11)], ids=["whole", "split"])


def _in_company(part: int, cut: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(lengths, slots, index of ours): chunk `part` of our sequence (slot 2) among others,
    at a different place in each call."""
    others = [(3, 0), (2, 4)]
    lengths, slots = [length for length, _ in others], [slot for _, slot in others]
    index = part % 3
    lengths.insert(index, cut)
    slots.insert(index, 2)
    return tuple(lengths), tuple(slots), index


@IMPLEMENTATIONS
@CUTS
def test_conv_is_the_same_split_or_batched(triton: bool, cuts: tuple[int, ...]) -> None:
    """Our 17 rows alone in one call, against the same rows cut into chunks (1-row chunks
    shift the window by less than its width), each chunk batched with other sequences."""
    conv = _conv(triton)
    weight, bias = _conv_weights(TAPS, torch.float32)
    x = _conv_rows(17, torch.float32)
    alone_state = torch.randn(NUM_SLOTS, CHANNELS, TAPS - 1)
    state = alone_state.clone()
    alone = conv(x, weight, bias, alone_state, *_batch((17,), (2,), (False,)))
    outs, start = [], 0
    for part, cut in enumerate(cuts):
        lengths, slots, index = _in_company(part, cut)
        others = [_conv_rows(length, torch.float32, seed=20 + i) for i, length in enumerate(lengths)]
        others[index] = x[start : start + cut]
        out = conv(torch.cat(others), weight, bias, state, *_batch(lengths, slots, [s != 2 or part > 0 for s in slots]))
        first = sum(lengths[:index])
        outs.append(out[first : first + cut])
        start += cut
    assert torch.equal(torch.cat(outs), alone)
    assert torch.equal(state[2], alone_state[2])


@IMPLEMENTATIONS
@CUTS
def test_gdn_is_the_same_split_or_batched(triton: bool, cuts: tuple[int, ...]) -> None:
    """The key property of the recurrent form, as above: equal bits however the rows come."""
    gdn = _gdn(triton)
    rows = _gdn_rows(17, torch.float32)
    alone_state = _gdn_state()
    state = alone_state.clone()
    alone = gdn(*rows, alone_state, *_batch((17,), (2,), (False,)))
    outs, start = [], 0
    for part, cut in enumerate(cuts):
        lengths, slots, index = _in_company(part, cut)
        others = [_gdn_rows(length, torch.float32, seed=20 + i) for i, length in enumerate(lengths)]
        others[index] = _take(rows, start, start + cut)
        out = gdn(*_cat(others), state, *_batch(lengths, slots, [s != 2 or part > 0 for s in slots]))
        first = sum(lengths[:index])
        outs.append(out[first : first + cut])
        start += cut
    assert torch.equal(torch.cat(outs), alone)
    assert torch.equal(state[2], alone_state[2])


@IMPLEMENTATIONS
def test_a_first_chunk_ignores_what_its_slot_held(triton: bool) -> None:
    """has_state=False: a slot full of NaN gives the bits of a slot of zeros, in both ops."""
    batch = _batch((5,), (1,), (False,))
    weight, bias = _conv_weights(TAPS, torch.float32)
    x, rows = _conv_rows(5, torch.float32), _gdn_rows(5, torch.float32)
    results = []
    for fill in (float("nan"), 0.0):
        conv_state = torch.full((NUM_SLOTS, CHANNELS, TAPS - 1), fill)
        state = torch.full((NUM_SLOTS, HEADS, HEAD_DIM, HEAD_DIM), fill)
        conv_out = _conv(triton)(x, weight, bias, conv_state, *batch)
        results.append((conv_out, conv_state[1], _gdn(triton)(*rows, state, *batch), state[1]))
    for garbage, zeros in zip(*results, strict=True):
        assert torch.equal(garbage, zeros)


def _batch_arguments() -> dict[str, object]:
    return dict(zip(("query_start", "slots", "has_state"), _batch((1, 5), (0, 1), (True, False)), strict=True))


def _conv_arguments() -> dict[str, object]:
    weight, bias = _conv_weights(TAPS, torch.float32)
    conv_state = torch.zeros(NUM_SLOTS, CHANNELS, TAPS - 1)
    return dict(x=_conv_rows(6, torch.float32), weight=weight, bias=bias, conv_state=conv_state, **_batch_arguments())


def _gdn_arguments() -> dict[str, object]:
    rows = dict(zip(("query", "key", "value", "g", "beta"), _gdn_rows(6, torch.float32), strict=True))
    return dict(**rows, state=_gdn_state(), **_batch_arguments())


CONV_MISTAKES = {
    "x": lambda a: a["x"][None],  # 3 dimensions
    "weight": lambda a: a["weight"].long(),
    "bias": lambda a: a["bias"][:-1],
    "conv_state": lambda a: a["conv_state"].double(),  # not x's dtype
    "query_start": lambda a: a["query_start"][:-1],
    "has_state": lambda a: a["has_state"].int(),
}
GDN_MISTAKES = {
    "query": lambda a: a["query"][0],  # 2 dimensions
    "key": lambda a: a["key"][:, :1],  # heads differ from query's
    "value": lambda a: a["value"][:, :3],  # 3 heads for 2 key heads
    "g": lambda a: a["g"].bfloat16(),
    "beta": lambda a: a["beta"][:, :2],
    "state": lambda a: a["state"].bfloat16(),  # not float32
    "slots": lambda a: a["slots"].float(),
}


@IMPLEMENTATIONS
@pytest.mark.parametrize("name", [*CONV_MISTAKES, "activation"])
def test_conv_rejects_bad_arguments(triton: bool, name: str) -> None:
    arguments = _conv_arguments()
    arguments[name] = CONV_MISTAKES[name](arguments) if name in CONV_MISTAKES else "relu"
    with pytest.raises(KernelArgumentError, match=f"^{name}"):
        _conv(triton)(**arguments)


@IMPLEMENTATIONS
@pytest.mark.parametrize("name", [*GDN_MISTAKES, "state heads"])
def test_gdn_rejects_bad_arguments(triton: bool, name: str) -> None:
    arguments = _gdn_arguments()
    if name == "state heads":
        arguments["state"], name = _gdn_state()[:, :2], "state"
    else:
        arguments[name] = GDN_MISTAKES[name](arguments)
    with pytest.raises(KernelArgumentError, match=f"^{name}"):
        _gdn(triton)(**arguments)
