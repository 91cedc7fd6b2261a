"""Host memory the way a CPU forward pass wants it: freed activation memory kept in the
process, and the KV cache on huge pages.

Freed activation memory: a CPU forward pass allocates and frees megabytes per layer (a
1024-token prefill: 12 MB for the gate/up projection alone). glibc serves blocks that large
with a fresh `mmap` and unmaps them on free, so every layer pays again for zero-filled page
faults: measured here, the prefill steps of `bench/throughput.py` took 16.7 s with glibc's
defaults and 15.1 s with these settings (the run 5% faster; vLLM's CPU engine preloads
tcmalloc for the same reason; jemalloc, tried, was slower than both). Memory is bounded by
the peak working set, which the engine holds at every step anyway.

Huge pages: decode attention reads every sequence's blocks, 4 KiB of one head each,
scattered over gigabytes, so on 4 KiB pages nearly every block costs a TLB miss. With 2 MiB
pages a decode step of 48 sequences of SmolLM2 (float32) took 1.5-3.5% less time here (two
sets of three alternating runs). Linux gives them only where asked (`madvise`, the default
mode of /sys/kernel/mm/transparent_hugepage/enabled) and before the memory is first touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import sys

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest; bigger blocks (the KV cache, weights) still get their own mapping
_TRIM_THRESHOLD = 1 << 30

_HUGE_PAGE = 2 << 20

_tuned = False


def keep_freed_memory() -> bool:
    """Tune glibc's allocator once per process; False where there is no glibc (macOS, musl)."""
    global _tuned
    if _tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    _tuned = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    if not _tuned:
        logger.debug("glibc refused the allocator settings; keeping its defaults")
    return _tuned


def zeros_on_huge_pages(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on a mapping of its own, asked for as huge pages before it is first
    touched, then touched at once (as `torch.zeros` would) so that no step pays for the page
    faults: left to the steps, a fresh 2 MiB page cost a cache write 1.3-2.6 ms here (the
    kernel compacting memory to find it), 4% of Gemma 3 270M's throughput benchmark, against
    0.2-0.3 s a GiB once at start. A fresh private mapping, not the allocator's: memory that
    glibc reuses from freed activations is already on 4 KiB pages. Where there is no
    MADV_HUGEPAGE: `torch.zeros`."""
    numel = math.prod(shape)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or numel == 0:
        return torch.zeros(*shape, dtype=dtype)
    size = numel * dtype.itemsize
    # One huge page more, to start the tensor on a 2 MiB boundary (mmap gives 4 KiB ones).
    mapping = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError as error:  # a kernel without transparent huge pages: ordinary pages
        logger.debug("madvise(MADV_HUGEPAGE) refused (%s): 4 KiB pages", error)
    offset = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % _HUGE_PAGE
    # The tensor holds a reference to the mapping, which is unmapped when the tensor goes.
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset).view(*shape)
    return tensor.zero_()
