"""The head's logits are the same to the bit whether its vocabulary is projected in one call
or in chunks (engine/layers/logits.py), and stay float32 in memory kept between calls."""

from __future__ import annotations

import pytest
import torch

from pagefleet.engine.layers.linear import _packable
from pagefleet.engine.layers.logits import LogitsHead


def _head(vocab: int, dtype: torch.dtype, chunk_columns: int, bias: bool) -> LogitsHead:
    torch.manual_seed(0)
    head = LogitsHead(48, vocab, chunk_columns=chunk_columns)
    head.weight.data = torch.randn(vocab, 48).to(dtype)
    if bias:
        head.bias = torch.nn.Parameter(torch.randn(vocab).to(dtype), requires_grad=False)
    head.pack()
    return head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logits_equal_one_calls_bit_for_bit(dtype: torch.dtype) -> None:
    if not _packable(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    whole = _head(1000, dtype, chunk_columns=1 << 20, bias=True)
    chunked = _head(1000, dtype, chunk_columns=96, bias=True)  # 11 chunks, the last one partial
    assert len(chunked._chunks) == 11 and whole._chunks == []
    for rows in (1, 2, 3, 17):
        hidden = torch.randn(rows, 48).to(dtype)
        expected = whole(hidden).clone()
        logits = chunked(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (rows, 1000)
        assert torch.equal(logits, expected), f"{rows} rows"
        reference = torch.nn.functional.linear(hidden.float(), whole.weight.float(), whole.bias.float())
        assert torch.allclose(logits, reference, rtol=0.05, atol=0.5)


def test_logits_live_in_kept_memory_until_the_next_call() -> None:
    head = _head(1000, torch.float32, chunk_columns=96, bias=False)
    first = head(torch.randn(4, 48))
    second = head(torch.randn(2, 48))
    assert first.data_ptr() == second.data_ptr()  # no fresh 32 MiB mapping every step
