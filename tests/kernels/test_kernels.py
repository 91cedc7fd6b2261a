"""Every Triton kernel, run by the interpreter on CPU tensors, against its torch reference.

Caches come in both layouts (the engine's head-major storage and plain contiguous), block
tables are shuffled and non-contiguous views, and contexts end inside, at the end of and
just past a block. Kernels get large tiles here: the interpreter pays per program step.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagefleet.kernels.checks import KernelArgumentError
from pagefleet.kernels.copy_blocks import copy_blocks, copy_blocks_torch
from pagefleet.kernels.lora import lora_expand, lora_expand_torch, lora_shrink, lora_shrink_torch
from pagefleet.kernels.paged_attention_decode import paged_attention_decode, paged_attention_decode_torch
from pagefleet.kernels.paged_attention_prefill import paged_attention_prefill, paged_attention_prefill_torch
from pagefleet.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_torch

pytestmark = pytest.mark.triton

NUM_BLOCKS = 48
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _caches(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, head_major: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (
        (num_kv_heads, NUM_BLOCKS, block_size, head_dim)
        if head_major
        else (NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    )
    pair = [torch.randn(shape, generator=generator).to(dtype) for _ in range(2)]
    if head_major:
        pair = [cache.permute(1, 2, 0, 3) for cache in pair]
    return pair


def _block_tables(lengths: list[int], block_size: int, seed: int = 0) -> torch.Tensor:
    """Shuffled, distinct blocks per sequence, as a non-contiguous column slice."""
    rng = random.Random(seed)
    pool = list(range(NUM_BLOCKS))
    rng.shuffle(pool)
    width = max((-(-n // block_size) for n in lengths), default=0)
    full = torch.zeros(len(lengths), width + 3, dtype=torch.int32)
    for row, length in enumerate(lengths):
        blocks = [pool.pop() for _ in range(-(-length // block_size))]
        full[row, 1 : 1 + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    tables = full[:, 1 : 1 + width]
    assert not tables.is_contiguous() or len(lengths) <= 1
    return tables


def _lengths(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, 3 * block_size + 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference(group: int, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    num_kv_heads = 2
    key_cache, value_cache = _caches(block_size, num_kv_heads, head_dim, dtype, head_major=group == 4)
    lengths = _lengths(block_size)
    tables = _block_tables(lengths, block_size)
    query = torch.randn(len(lengths), num_kv_heads * group, head_dim).to(dtype)
    context = torch.tensor(lengths, dtype=torch.int32)
    args = (query, key_cache, value_cache, tables, context, head_dim**-0.5)
    expected = paged_attention_decode_torch(*args)
    torch.testing.assert_close(paged_attention_decode(*args, tile_n=64), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("window", [1, 5, 16])
def test_decode_sliding_window(window: int) -> None:
    key_cache, value_cache = _caches(8, 2, 64, torch.float32, head_major=True)
    lengths = _lengths(8)
    tables = _block_tables(lengths, 8)
    query = torch.randn(len(lengths), 8, 64)
    args = (query, key_cache, value_cache, tables, torch.tensor(lengths), 0.125)
    expected = paged_attention_decode_torch(*args, sliding_window=window)
    torch.testing.assert_close(paged_attention_decode(*args, sliding_window=window, tile_n=16), expected)


def test_decode_empty_and_single_sequence() -> None:
    key_cache, value_cache = _caches(16, 1, 64, torch.float32, head_major=False)
    empty = paged_attention_decode(
        torch.empty(0, 4, 64),
        key_cache,
        value_cache,
        torch.empty(0, 1, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        0.1,
    )
    assert empty.shape == (0, 4, 64)
    args = (torch.randn(1, 4, 64), key_cache, value_cache, _block_tables([40], 16), torch.tensor([40]), 0.1)
    torch.testing.assert_close(paged_attention_decode(*args), paged_attention_decode_torch(*args))


def _prefill_batch(block_size: int) -> tuple[list[int], list[int]]:
    """(query lengths, context lengths): whole prompts, chunks after a cached prefix, and a
    prefix-cache hit that leaves one token."""
    lengths = _lengths(block_size)
    query_lens = [1, block_size - 1, 5, 7]
    return query_lens, lengths[:1] + [lengths[1], lengths[2] + 5, lengths[3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_matches_reference(group: int, block_size: int, head_dim: int, dtype: torch.dtype) -> None:
    num_kv_heads = 1
    key_cache, value_cache = _caches(block_size, num_kv_heads, head_dim, dtype, head_major=group != 4)
    query_lens, context_lens = _prefill_batch(block_size)
    tables = _block_tables(context_lens, block_size)
    cu_seqlens = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim).to(dtype)
    args = (query, key_cache, value_cache, tables, cu_seqlens, torch.tensor(context_lens), head_dim**-0.5)
    expected = paged_attention_prefill_torch(*args)
    got = paged_attention_prefill(*args, max(query_lens), block_m=16, tile_n=64)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("window", [1, 6])
def test_prefill_sliding_window_and_whole_prompt(window: int) -> None:
    key_cache, value_cache = _caches(8, 2, 64, torch.float32, head_major=True)
    query_lens, context_lens = [20, 3], [20, 30]  # a whole prompt, and a chunk after 27 cached
    tables = _block_tables(context_lens, 8)
    cu_seqlens = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(23, 4, 64)
    args = (query, key_cache, value_cache, tables, cu_seqlens, torch.tensor(context_lens), 0.125)
    expected = paged_attention_prefill_torch(*args, sliding_window=window)
    got = paged_attention_prefill(*args, 20, sliding_window=window, block_m=16, tile_n=16)
    torch.testing.assert_close(got, expected)


def test_prefill_empty_batch() -> None:
    key_cache, value_cache = _caches(8, 1, 64, torch.float32, head_major=False)
    none = torch.empty(0, dtype=torch.int32)
    out = paged_attention_prefill(
        torch.empty(0, 2, 64),
        key_cache,
        value_cache,
        torch.empty(0, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        none,
        0.1,
        0,
    )
    assert out.shape == (0, 2, 64)


SOFTCAP = 30.0  # Gemma 2's attn_logit_softcapping


def _large_query(tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Scores of a few tens at scale head_dim**-0.5, where tanh bends and the cap matters."""
    return (8 * torch.randn(tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(1))).to(dtype)


def _softcap_decode_args(dtype: torch.dtype) -> tuple:
    key_cache, value_cache = _caches(8, 2, 80, dtype, head_major=True)
    lengths = _lengths(8)
    query = _large_query(len(lengths), 8, 80, dtype)
    return query, key_cache, value_cache, _block_tables(lengths, 8), torch.tensor(lengths), 80**-0.5


def _softcap_prefill_args(dtype: torch.dtype) -> tuple:
    key_cache, value_cache = _caches(8, 2, 64, dtype, head_major=False)
    query_lens, context_lens = [20, 3], [20, 30]  # a whole prompt, and a chunk after 27 cached
    cu_seqlens = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = _large_query(23, 4, 64, dtype)
    tables = _block_tables(context_lens, 8)
    return query, key_cache, value_cache, tables, cu_seqlens, torch.tensor(context_lens), 0.125


def test_softcap_changes_the_references() -> None:
    """Guards the soft-cap tests against passing with the cap ignored everywhere."""
    decode = _softcap_decode_args(torch.float32)
    capped = paged_attention_decode_torch(*decode, softcap=SOFTCAP)
    assert (capped - paged_attention_decode_torch(*decode)).abs().max() > 0.1
    prefill = _softcap_prefill_args(torch.float32)
    capped = paged_attention_prefill_torch(*prefill, softcap=SOFTCAP)
    assert (capped - paged_attention_prefill_torch(*prefill)).abs().max() > 0.1


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_softcap(dtype: torch.dtype, window: int | None) -> None:
    args = _softcap_decode_args(dtype)
    expected = paged_attention_decode_torch(*args, sliding_window=window, softcap=SOFTCAP)
    got = paged_attention_decode(*args, sliding_window=window, softcap=SOFTCAP, tile_n=16)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_softcap(dtype: torch.dtype, window: int | None) -> None:
    args = _softcap_prefill_args(dtype)
    expected = paged_attention_prefill_torch(*args, sliding_window=window, softcap=SOFTCAP)
    got = paged_attention_prefill(*args, 20, sliding_window=window, softcap=SOFTCAP, block_m=16, tile_n=16)
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def _sinks(num_heads: int) -> torch.Tensor:
    """gpt-oss's sinks: a logit per head, some above the scores (the sink takes most), some below."""
    return torch.linspace(-4.0, 12.0, num_heads)


@pytest.mark.parametrize("window", [None, 6])
def test_decode_sinks(window: int | None) -> None:
    args = _softcap_decode_args(torch.float32)
    expected = paged_attention_decode_torch(*args, sliding_window=window, sinks=_sinks(8))
    assert (expected - paged_attention_decode_torch(*args, sliding_window=window)).abs().max() > 0.1
    got = paged_attention_decode(*args, sliding_window=window, sinks=_sinks(8), tile_n=16)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_sinks(window: int | None) -> None:
    args = _softcap_prefill_args(torch.float32)
    expected = paged_attention_prefill_torch(*args, sliding_window=window, sinks=_sinks(4))
    assert (expected - paged_attention_prefill_torch(*args, sliding_window=window)).abs().max() > 0.1
    got = paged_attention_prefill(*args, 20, sliding_window=window, sinks=_sinks(4), block_m=16, tile_n=16)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("chunk", [4, 7])
def test_decode_and_prefill_chunked_attention(chunk: int) -> None:
    """Llama 4's chunks, smaller than a tile (and not a multiple of it)."""
    decode = _softcap_decode_args(torch.float32)
    expected = paged_attention_decode_torch(*decode, chunk=chunk)
    assert (expected - paged_attention_decode_torch(*decode)).abs().max() > 0.1
    got = paged_attention_decode(*decode, chunk=chunk, tile_n=16)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    prefill = _softcap_prefill_args(torch.float32)
    expected = paged_attention_prefill_torch(*prefill, chunk=chunk)
    got = paged_attention_prefill(*prefill, 20, chunk=chunk, block_m=16, tile_n=16)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_major", [True, False])
def test_reshape_and_cache_matches_reference(head_major: bool, dtype: torch.dtype) -> None:
    ours = _caches(16, 2, 80, dtype, head_major)
    reference = [cache.clone() for cache in ours]
    key, value = torch.randn(6, 2, 80).to(dtype), torch.randn(6, 2, 80).to(dtype)
    slots = torch.tensor([5, -1, 17, 100, -1, 16 * NUM_BLOCKS - 1])  # -1: padding, skipped
    reshape_and_cache(key, value, *ours, slots)
    reshape_and_cache_torch(key, value, *reference, slots)
    assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])
    assert torch.equal(ours[0][100 // 16, 100 % 16], key[3])


@pytest.mark.parametrize("head_major", [True, False])
def test_copy_blocks_matches_reference(head_major: bool) -> None:
    ours = _caches(8, 2, 64, torch.bfloat16, head_major)
    reference = [cache.clone() for cache in ours]
    mapping = torch.tensor([[3, 40], [0, 7], [47, 1]])
    copy_blocks(*ours, mapping)
    copy_blocks_torch(*reference, mapping)
    assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])
    assert torch.equal(ours[1][40], ours[1][3])


def test_launchers_reject_bad_tensors_clearly() -> None:
    key_cache, value_cache = _caches(8, 2, 64, torch.float32, head_major=False)
    tables, lengths = _block_tables([9], 8), torch.tensor([9])
    with pytest.raises(KernelArgumentError, match="query dtype"):
        paged_attention_decode(torch.randn(1, 4, 64).half(), key_cache, value_cache, tables, lengths, 0.1)
    with pytest.raises(KernelArgumentError, match="multiple of num_kv_heads"):
        paged_attention_decode(torch.randn(1, 3, 64), key_cache, value_cache, tables, lengths, 0.1)
    with pytest.raises(KernelArgumentError, match="last dimension must be contiguous"):
        strided = torch.randn(1, 4, 128)[:, :, ::2]
        paged_attention_decode(strided, key_cache, value_cache, tables, lengths, 0.1)
    with pytest.raises(KernelArgumentError, match="block_tables: 1 rows for 2 sequences"):
        paged_attention_decode(torch.randn(2, 4, 64), key_cache, value_cache, tables, torch.tensor([9, 9]), 0.1)
    with pytest.raises(KernelArgumentError, match="slot_mapping: dtype float32"):
        reshape_and_cache(torch.randn(1, 2, 64), torch.randn(1, 2, 64), key_cache, value_cache, torch.zeros(1))
    with pytest.raises(KernelArgumentError, match="value_cache"):
        copy_blocks(key_cache, value_cache[:4], torch.tensor([[0, 1]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("in_features", "rank", "out_features"), [(64, 8, 96), (200, 48, 40)])
def test_lora_shrink_and_expand_match_their_references(
    dtype: torch.dtype, in_features: int, rank: int, out_features: int
) -> None:
    """A batch mixing three adapter slots and base-model rows (-1), in no order."""
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(11, in_features, generator=generator).to(dtype)
    a = torch.randn(3, rank, in_features, generator=generator).to(dtype)
    b = torch.randn(3, out_features, rank, generator=generator).to(dtype)
    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0, 0, 2, 1, -1])
    shrunk, expected = lora_shrink(x, a, slots), lora_shrink_torch(x, a, slots)
    torch.testing.assert_close(shrunk, expected, **TOLERANCE[dtype])
    assert torch.all(shrunk[slots < 0] == 0)
    y = torch.randn(11, out_features, generator=generator).to(dtype)
    y_reference = y.clone()
    lora_expand(expected, b, slots, y)
    lora_expand_torch(expected, b, slots, y_reference)
    # Sums of a rank's worth of products of O(10) terms: the order of additions shows at 1e-5.
    scaled = {torch.float32: dict(atol=1e-3, rtol=1e-4), torch.bfloat16: dict(atol=0.5, rtol=2e-2)}
    torch.testing.assert_close(y, y_reference, **scaled[dtype])
    base = torch.randn(11, out_features, generator=generator).to(dtype)  # rows of no adapter stay as they were
    untouched = base.clone()
    lora_expand(expected, b, torch.full_like(slots, -1), untouched)
    assert torch.equal(untouched, base)
