"""The KV cache is allocated on huge pages where Linux gives them, and is zeroed either way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pagefleet.engine.core.host_memory import keep_freed_memory
from pagefleet.engine.layers.attention import allocate_kv_cache, head_major

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of this process's mappings over the tensor's memory (madvise splits a
    mapping where the advice starts)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            overlaps = int(span.group(1), 16) < end and start < int(span.group(2), 16)
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_a_cpu_kv_cache_is_zeroed_and_on_huge_pages() -> None:
    if not THP_MODE.exists() or "[never]" in THP_MODE.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    # As in a running engine: glibc keeps freed activations, already on 4 KiB pages, and would
    # hand them out again for a cache of this size.
    keep_freed_memory()
    freed = torch.ones(5 << 20)  # 20 MB, below the mmap threshold keep_freed_memory sets
    del freed
    cache = allocate_kv_cache(2048, 16, 2, 64, torch.float32, "cpu")  # 16 MiB
    assert cache.shape == (2048, 16, 2, 64) and not cache.any()
    assert _huge_kib(head_major(cache)) == 16 * 1024
