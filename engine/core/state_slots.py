"""The state cache's slots: one per running sequence of a model with state layers
(Gated DeltaNet's convolution window and recurrent matrix, per layer), beside the paged KV.

A slot is a row of every state layer's tensors (the runner owns those, engine/worker/
state_cache.py). Unlike a block it is never shared and never cached: a sequence takes one
when it first computes a token, keeps it while it runs and frees it when it finishes, is
aborted or is preempted (recompute starts again from an empty state). A fork copies the
parent's row into the child's (`StateCopy`, run before the next forward pass).
"""

from __future__ import annotations

from collections import deque

StateCopy = tuple[int, int]  # (source slot, destination slot)


class StateSlots:
    """A free list of `num_slots` slots. Written by KVCacheManager alone."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def try_allocate(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"state slot {slot} freed twice"
        self._free.append(slot)
