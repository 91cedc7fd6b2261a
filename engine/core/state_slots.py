"""The state cache's slots: one per running sequence of a model with state layers (Gated
DeltaNet's or Mamba-2's convolution window and recurrent state, per layer), beside the
paged KV.

A slot is a row of every state layer's tensors (the runner owns those, engine/worker/
state_cache.py). Unlike a block it is never shared: a sequence takes one when it first
computes a token, keeps it while it runs and frees it when it finishes, is aborted or is
preempted by recompute (it then starts again from an empty state). A fork copies the
parent's row into the child's; a swap-out copies a sequence's row to a host slot and frees
the device one, a swap-in the reverse. The copies queue as `StateCopy` pairs and run before
the next forward pass, with the block copies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

StateCopy = tuple[int, int]  # (source slot, destination slot)
StateLoad = tuple[int, Any]  # (destination slot, the StateRows of a prefix from outside)


class StateSlots:
    """A free list of `num_slots` slots."""

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


class StateSlotTable:
    """Which slot each sequence holds: on the device while it runs, on the host while it is
    swapped out. Written by KVCacheManager alone (through these methods); copies it decides
    are appended to the lists the caller passes."""

    def __init__(self, num_slots: int, num_host_slots: int = 0) -> None:
        self.device = StateSlots(num_slots)
        self.host = StateSlots(num_host_slots)
        self._device: dict[int, int] = {}  # seq_id -> device slot
        self._host: dict[int, int] = {}  # seq_id -> host slot

    def slot(self, seq_id: int) -> int | None:
        return self._device.get(seq_id)

    def try_take(self, seq_id: int) -> bool:
        """Give the sequence a device slot if it has none; False if none is free."""
        if seq_id in self._device:
            return True
        slot = self.device.try_allocate()
        if slot is None:
            return False
        self._device[seq_id] = slot
        return True

    def fork(self, parent_id: int, child_id: int, copies: list[StateCopy]) -> None:
        """The child gets a slot holding a copy of the parent's state (if it has one)."""
        parent = self._device.get(parent_id)
        if parent is None:
            return
        child = self.device.try_allocate()
        assert child is not None, "a slot per sequence: admission counts a request's siblings"
        self._device[child_id] = child
        copies.append((parent, child))

    def free(self, seq_id: int) -> None:
        """Forget the sequence, freeing its device or host slot."""
        if (slot := self._device.pop(seq_id, None)) is not None:
            self.device.free(slot)
        if (slot := self._host.pop(seq_id, None)) is not None:
            self.host.free(slot)

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        return sum(seq_id in self._device for seq_id in seq_ids) <= self.host.num_free_slots

    def swap_out(self, seq_ids: Iterable[int], copies: list[StateCopy]) -> None:
        for seq_id in seq_ids:
            if (slot := self._device.pop(seq_id, None)) is None:
                continue
            host = self.host.try_allocate()
            assert host is not None, "can_swap_out said the host slots were free"
            copies.append((slot, host))
            self._host[seq_id] = host
            self.device.free(slot)

    def swap_in(self, seq_ids: Iterable[int], copies: list[StateCopy]) -> None:
        for seq_id in seq_ids:
            if (host := self._host.pop(seq_id, None)) is None:
                continue
            slot = self.device.try_allocate()
            assert slot is not None, "a slot per sequence: max_num_seqs counts a swapped-in request's"
            copies.append((host, slot))
            self._device[seq_id] = slot
            self.host.free(host)
