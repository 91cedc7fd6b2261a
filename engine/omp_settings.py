"""OpenMP's spin-waiting, which libgomp reads once: when torch first loads it.

OpenMP's worker threads between the parallel regions of a step: under
OMP_WAIT_POLICY=PASSIVE libgomp puts them to sleep at once, and waking one costs ~45 us, a
few hundred times a step. Spinning up to ~3 ms first (libgomp's own default without a
policy; vLLM asks Intel's OpenMP for 5 ms, KMP_BLOCKTIME=5) made the offline workload 8%
faster in bfloat16 and 3% in float32 (docs/benchmarks.md). A GOMP_SPINCOUNT of the
caller's wins, and `pagefleet up` gives its replicas 0, since they share the machine's cores.

This module imports no torch: `pagefleet.engine` applies it before importing torch.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "300000"

_CALLERS_SPIN_COUNT = "GOMP_SPINCOUNT" in os.environ
_TORCH_CAME_FIRST = "torch" in sys.modules


def apply() -> None:
    """Ask for the spin count, unless the caller chose one (too late if torch came first)."""
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)


def engine_threads() -> int:
    """The OpenMP threads an engine on the CPU runs (see engine_setup)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0]))
    except ValueError:
        return max(1, os.cpu_count() or 1)


def lost_in_this_process(num_threads: int) -> bool:
    """Whether this process's OpenMP threads sleep between a step's parallel regions because
    torch loaded libgomp before `apply` ran (the caller imported torch first) under
    OMP_WAIT_POLICY=PASSIVE: 9-10% slower offline on SmolLM2 in float32. One thread never
    waits for another, so it loses nothing."""
    passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    return _TORCH_CAME_FIRST and not _CALLERS_SPIN_COUNT and passive and num_threads > 1
