"""The compiled CPU operators equal their plain-torch references, and the engine falls back
to torch, saying so once, where they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pagefleet.engine.layers import fused
from pagefleet.engine.layers.attention import allocate_kv_cache
from pagefleet.kernels import cpu_ops
from pagefleet.kernels.cpu_attention import (
    paged_attention_decode_cpu,
    paged_attention_prefill_cpu,
    reshape_and_cache_cpu,
)
from pagefleet.kernels.paged_attention_decode import paged_attention_decode_torch
from pagefleet.kernels.paged_attention_prefill import paged_attention_prefill_torch
from pagefleet.kernels.reshape_and_cache import reshape_and_cache_torch

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}  # bf16: the rounding of the output


@pytest.fixture(scope="module", autouse=True)
def operators() -> None:
    assert cpu_ops.load(), "g++ and ninja are on every machine here: the operators must build"


def _caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, layout: str):
    if layout == "head_major":  # the engine's layout
        caches = [allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, "cpu") for _ in range(2)]
    else:
        caches = [torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    for cache in caches:
        cache.normal_()
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_attention_equals_the_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, window: int | None
) -> None:
    generator = torch.Generator().manual_seed(head_dim + block_size)
    lengths = [1, 2, block_size - 1, block_size, 3 * block_size + 5, 700, 3000]
    max_blocks = -(-max(lengths) // block_size)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 7
    layout = "head_major" if block_size == 16 else "contiguous"
    key_cache, value_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, layout)
    # Every sequence's blocks scattered over the cache, in shuffled order.
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(lengths), max_blocks + 3, dtype=torch.int32)  # wider than needed
    used = 0
    for row, length in enumerate(lengths):
        count = -(-length // block_size)
        tables[row, :count] = order[used : used + count]
        used += count
    query = torch.randn(len(lengths), num_heads, head_dim, generator=generator).to(dtype)
    context_lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim**-0.5
    expected = paged_attention_decode_torch(query, key_cache, value_cache, tables, context_lens, scale, window)
    actual = paged_attention_decode_cpu(query, key_cache, value_cache, tables, context_lens, scale, window)
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["head_major", "contiguous"])
def test_cache_write_equals_the_reference(dtype: torch.dtype, layout: str) -> None:
    num_blocks, block_size = 48, 16
    ours = _caches(num_blocks, block_size, 3, 64, dtype, layout)
    reference = [cache.clone() for cache in ours]
    key, value = torch.randn(700, 3, 64).to(dtype), torch.randn(700, 3, 64).to(dtype)
    # Slots in shuffled order, with padding (-1) skipped, and more tokens than one thread's share.
    slots = torch.randperm(num_blocks * block_size)[:700].clone()
    slots[::7] = -1
    reshape_and_cache_cpu(key, value, *ours, slots)
    reshape_and_cache_torch(key, value, *reference, slots)
    assert torch.equal(ours[0], reference[0]) and torch.equal(ours[1], reference[1])
    with pytest.raises(RuntimeError, match="past the cache"):
        reshape_and_cache_cpu(key[:1], value[:1], *ours, torch.tensor([num_blocks * block_size]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 80, 16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 100])
def test_prefill_attention_equals_the_reference_and_each_row_as_a_decode(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, window: int | None
) -> None:
    generator = torch.Generator().manual_seed(head_dim + block_size + num_heads)
    # (new tokens, cached prefix): a lone token, short and long chunks, chunks after a
    # cached prefix (chunked prefill, prefix hits), one longer than the window.
    chunks = [(1, 0), (block_size + 1, 0), (300, 0), (40, 3 * block_size), (5, 700), (130, 2000)]
    max_blocks = max(-(-(n + p) // block_size) for n, p in chunks)
    num_blocks = sum(-(-(n + p) // block_size) for n, p in chunks) + 7
    layout = "head_major" if block_size == 16 else "contiguous"
    key_cache, value_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, layout)
    tables, cu_seqlens, context_lens = _scattered_tables(chunks, num_blocks, max_blocks + 2, block_size, generator)
    query = torch.randn(int(cu_seqlens[-1]), num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5
    args = (query, key_cache, value_cache, tables, cu_seqlens, context_lens, scale)
    expected = paged_attention_prefill_torch(*args, sliding_window=window)
    actual = paged_attention_prefill_cpu(*args, sliding_window=window)
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # Path invariance: each prompt row gives the bits it gives as a decode of its own, alone.
    row_tables = torch.repeat_interleave(tables, cu_seqlens.diff().long(), dim=0)
    row_lengths = torch.cat([torch.arange(p + 1, p + n + 1) for n, p in chunks]).int()
    for row in (0, 1, int(cu_seqlens[2]) + 150, int(cu_seqlens[-1]) - 1):
        alone = paged_attention_decode_cpu(
            query[row : row + 1],
            key_cache,
            value_cache,
            row_tables[row : row + 1],
            row_lengths[row : row + 1],
            scale,
            window,
        )
        assert torch.equal(alone, actual[row : row + 1]), f"row {row}"


def _scattered_tables(
    chunks: list[tuple[int, int]], num_blocks: int, width: int, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tables [len(chunks), width] whose blocks lie scattered over the cache, one
    sequence per (new tokens, cached prefix) chunk; and the chunks' cu_seqlens and context
    lengths, as the prefill operator takes them."""
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.zeros(len(chunks), width, dtype=torch.int32)
    used = 0
    for row, (new, prefix) in enumerate(chunks):
        count = -(-(new + prefix) // block_size)
        tables[row, :count] = order[used : used + count]
        used += count
    cu_seqlens = torch.tensor([0, *torch.tensor([n for n, _ in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    context_lens = torch.tensor([n + p for n, p in chunks], dtype=torch.int32)
    return tables, cu_seqlens, context_lens


SOFTCAP = 30.0  # Gemma 2's attn_logit_softcapping


def _rows_and_decodes_equal_the_reference(
    dtype: torch.dtype, head_dim: int, seed: int, query_scale: float, differs: bool, **layer: Any
) -> None:
    """Prompt chunks over one and several partitions (a row alone, a whole prompt, chunks
    after 300 and 700 cached tokens), attended with the layer's options `layer` by the
    operator and the reference; each chunk's last row, as a decode, is its prompt row's bits.
    `differs`: the options must change the reference's result (they cannot be ignored)."""
    generator = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, block_size = 6, 2, 16
    chunks = [(1, 0), (40, 0), (5, 300), (20, 700)]  # (new tokens, cached prefix)
    num_blocks = sum(-(-(n + p) // block_size) for n, p in chunks) + 3
    key_cache, value_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, "head_major")
    width = -(-max(n + p for n, p in chunks) // block_size)
    tables, cu_seqlens, context_lens = _scattered_tables(chunks, num_blocks, width, block_size, generator)
    query = (query_scale * torch.randn(int(cu_seqlens[-1]), num_heads, head_dim, generator=generator)).to(dtype)
    scale = head_dim**-0.5
    tolerance = dict(atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    args = (query, key_cache, value_cache, tables, cu_seqlens, context_lens, scale)
    expected = paged_attention_prefill_torch(*args, **layer)
    if differs:
        plain = {"sliding_window": layer.get("sliding_window")}
        assert not torch.allclose(expected.float(), paged_attention_prefill_torch(*args, **plain).float())
    rows = paged_attention_prefill_cpu(*args, **layer)
    torch.testing.assert_close(rows.float(), expected.float(), **tolerance)
    last = cu_seqlens[1:].long() - 1
    decode = (query[last], key_cache, value_cache, tables, context_lens, scale)
    decoded = paged_attention_decode_cpu(*decode, **layer)
    torch.testing.assert_close(decoded.float(), paged_attention_decode_torch(*decode, **layer).float(), **tolerance)
    assert torch.equal(decoded, rows[last])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80, 20], ids=["avx512", "avx2", "any"])  # which kernel scores
@pytest.mark.parametrize("window", [None, 100])
def test_softcapped_attention_equals_the_reference(dtype: torch.dtype, head_dim: int, window: int | None) -> None:
    """Scores large enough (a query 8 times the usual) for the cap to matter."""
    _rows_and_decodes_equal_the_reference(dtype, head_dim, head_dim, 8.0, False, sliding_window=window, softcap=SOFTCAP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80], ids=["avx512", "avx2"])
@pytest.mark.parametrize("window", [None, 100])
def test_attention_with_sinks_equals_the_reference(dtype: torch.dtype, head_dim: int, window: int | None) -> None:
    """gpt-oss's sinks (one logit per head in each denominator), including a row whose only
    key is itself; a sink as large as the scores (it takes a real share) and one far below
    (it takes none)."""
    sinks = torch.tensor([0.0, 3.0, -1.0, 8.0, -30.0, 1.5])
    _rows_and_decodes_equal_the_reference(dtype, head_dim, head_dim + 1, 4.0, True, sliding_window=window, sinks=sinks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 80], ids=["avx512", "avx2"])
@pytest.mark.parametrize("chunk", [16, 100, 256])
def test_chunked_attention_equals_the_reference(dtype: torch.dtype, head_dim: int, chunk: int) -> None:
    """Llama 4's chunked attention: each row sees its own chunk only, rows on both sides of a
    chunk boundary, chunks smaller and larger than a partition."""
    _rows_and_decodes_equal_the_reference(dtype, head_dim, head_dim + chunk, 1.0, True, chunk=chunk)


def test_operators_called_without_a_softcap_have_none() -> None:
    """Callers written before the soft-cap (the schemas' default 0.0) get the uncapped bits."""
    key_cache, value_cache = _caches(8, 16, 2, 64, torch.float32, "head_major")
    query = 8 * torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0))
    tables, lengths = torch.arange(6, dtype=torch.int32).view(3, 2), torch.tensor([5, 17, 32], dtype=torch.int32)
    old = torch.ops.pagefleet.paged_attention_decode(query, key_cache, value_cache, tables, lengths, 0.125, 0)
    assert torch.equal(old, paged_attention_decode_cpu(query, key_cache, value_cache, tables, lengths, 0.125))
    assert torch.equal(
        old, paged_attention_decode_cpu(query, key_cache, value_cache, tables, lengths, 0.125, None, 0.0)
    )
    groups = torch.arange(4, dtype=torch.int32)
    rows = torch.ops.pagefleet.paged_attention_rows(query, key_cache, value_cache, tables, lengths, groups, 0.125, 0)
    assert torch.equal(rows, old)
    capped = paged_attention_decode_cpu(query, key_cache, value_cache, tables, lengths, 0.125, None, SOFTCAP)
    assert not torch.allclose(capped, old, atol=1e-2)


def test_decode_attention_of_no_sequence_is_empty() -> None:
    key_cache, value_cache = _caches(4, 16, 2, 64, torch.float32, "head_major")
    out = paged_attention_decode_cpu(
        torch.empty(0, 4, 64),
        key_cache,
        value_cache,
        torch.empty(0, 1, dtype=torch.int32),
        torch.empty(0, dtype=torch.int32),
        0.125,
    )
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_element_wise_ops_equal_their_references(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    hidden = (torch.randn(37, 576, generator=generator) * 3).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    # float32: summation order only; bfloat16: at most one rounding step (2**-7) apart.
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2**-7}
    torch.testing.assert_close(
        fused.rms_norm(hidden, weight, 1e-5), fused.rms_norm_torch(hidden, weight, 1e-5), **tolerance
    )
    gate_up = (torch.randn(37, 2 * 1536, generator=generator) * 4).to(dtype)
    torch.testing.assert_close(fused.silu_and_mul(gate_up), fused.silu_and_mul_torch(gate_up), **tolerance)
    torch.testing.assert_close(fused.gelu_tanh_and_mul(gate_up), fused.gelu_tanh_and_mul_torch(gate_up), **tolerance)
    heads = hidden[:, :512].reshape(37, 2, 256)  # Gemma's q/k norms: per head
    for x in (hidden, heads):
        gemma = fused.gemma_rms_norm(x, weight[: x.shape[-1]], 1e-6)
        torch.testing.assert_close(gemma, fused.gemma_rms_norm_torch(x, weight[: x.shape[-1]], 1e-6), **tolerance)
    qkv = torch.randn(37, 9 * 64 + 6 * 64, generator=generator).to(dtype)
    query = qkv[:, : 9 * 64].view(37, 9, 64)  # a strided view, as the models pass it
    cos = torch.randn(37, 1, 64, generator=generator).to(dtype)
    sin = torch.randn(37, 1, 64, generator=generator).to(dtype)
    torch.testing.assert_close(fused.rotary(query, cos, sin), fused.rotary_torch(query, cos, sin), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_argmax_is_torchs_ties_nans_and_infinities_included(dtype: torch.dtype) -> None:
    """The sampler's argmax gives torch.argmax's index on every row: the first of equal
    maxima (within a 16-wide lane and across lanes), the first NaN, -inf rows, rows shorter
    than a vector and with a tail, rows strided in a wider tensor."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 1000, generator=generator).to(dtype)
    logits[1, [7, 300, 999]] = 50.0  # ties in different lanes and the tail
    logits[2, [31, 15]] = 50.0  # ties in the same lane... and an earlier one in another
    logits[3, [200, 5]] = float("nan")
    logits[4] = float("-inf")
    logits[5, 998] = float("inf")
    logits[6, 0] = float("nan")
    logits[7, 999] = 60.0  # the maximum in the tail
    wide = torch.randn(12, 1200, generator=generator).to(dtype)
    wide[:, :1000] = logits
    for x in (logits, logits[:, :9], logits[:, :17], wide[:, :1000]):
        assert torch.equal(fused.argmax_rows(x), x.argmax(dim=-1)), f"rows of {x.shape[1]}"
    assert fused.argmax_rows(logits)[[1, 2, 3, 4, 6, 7]].tolist() == [7, 15, 5, 0, 0, 999]


def test_without_a_compiler_the_engine_says_so_once_and_runs_on_torch(tiny_llama: Path, tmp_path: Path) -> None:
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING);"
        "from pagefleet.engine import LLM, SamplingParams;"
        f"llm = LLM({str(tiny_llama)!r}, dtype='float32');"
        "print('backend', llm.engine.runner.backend.name);"
        "params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True);"
        "print('tokens', llm.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids)"
    )
    # An empty cache (nothing built before) and a compiler that does not exist.
    env = {**os.environ, "PAGEFLEET_CACHE_DIR": str(tmp_path), "CXX": str(tmp_path / "no-such-g++")}
    env.pop("PAGEFLEET_OPS_DIR", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend torch" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "compiled CPU operators are unavailable" in line]
    assert len(warnings) == 1, result.stderr[-3000:]
    from pagefleet.engine import LLM, SamplingParams

    compiled = LLM(str(tiny_llama), dtype="float32")
    assert compiled.engine.runner.backend.name == "cpu"
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = compiled.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids
    assert f"tokens {expected}" in result.stdout


def test_a_lock_left_by_a_killed_build_does_not_block_later_builds(tmp_path: Path) -> None:
    """cpp_extension's lock file outlives a build that was killed; every later process would
    wait on it forever. An old one is removed, a fresh one (a build running now) is not."""
    lock = tmp_path / "lock"
    lock.touch()
    cpu_ops._clear_stale_lock(lock)
    assert lock.exists(), "a build may be running: leave its lock"
    old = time.time() - cpu_ops.STALE_LOCK_SECONDS - 1
    os.utime(lock, (old, old))
    cpu_ops._clear_stale_lock(lock)
    assert not lock.exists()
