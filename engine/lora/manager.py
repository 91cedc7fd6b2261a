"""The adapters a model serves: host copies by name, and `max_loras` device slots.

An adapter is read from disk once (`add`, off the engine's lock) and kept in host memory.
A request runs only while its adapter sits in a slot: the scheduler `acquire`s one when it
admits the request and `release`s it when the request finishes or is preempted. A missing
adapter is copied into a free slot, or into the least recently used slot that no running
request holds; when every slot is held, the request waits (`acquire` returns None).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

import torch

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.layers.linear import Linear
from pagefleet.engine.lora.adapter import LoRAAdapter, LoRATarget, load_adapter
from pagefleet.engine.lora.layer import LoRABatch, LoRAContext, LoRALayer
from pagefleet.engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self,
        targets: dict[str, LoRATarget],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.targets, self.max_rank, self.dtype, self.device = targets, max_rank, dtype, device
        self.context = LoRAContext()
        by_linear: dict[int, list[LoRATarget]] = defaultdict(list)
        for target in targets.values():
            by_linear[id(target.linear)].append(target)
        self.layers: dict[int, LoRALayer] = {}
        for parts in by_linear.values():
            linear: Linear = parts[0].linear
            segments = [(0, 0)] * parts[0].num_segments
            for part in parts:
                segments[part.segment] = (part.row_start, part.row_end)
            out_features, in_features = linear.out_features, linear.in_features
            layer = LoRALayer(self.context, in_features, out_features, segments, max_loras, max_rank, dtype, device)
            linear.lora = layer
            self.layers[id(linear)] = layer
        self.adapters: dict[str, LoRAAdapter] = {}  # host copies, by name
        self.slots: list[str | None] = [None] * max_loras
        self._holders = [0] * max_loras  # running requests per slot
        self._last_used = [0] * max_loras
        self._clock = 0
        self._lock = threading.Lock()  # `add` runs on the adder threads; the rest on the engine's
        self.num_loads = 0  # adapters copied into a slot (what eviction costs)

    @property
    def bytes_per_slot(self) -> int:
        return sum(layer.bytes_per_slot for layer in self.layers.values())

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read from disk the first time its name is seen.

        Raises:
            InvalidParameterError: an unreadable adapter, or a name taken by another path.
        """
        with self._lock:
            known = self.adapters.get(request.lora_name)
        if known is not None:
            if request.lora_path and known.request.lora_path != request.lora_path:
                raise InvalidParameterError(
                    "lora_request", f"adapter {request.lora_name!r} is already loaded from {known.request.lora_path}"
                )
            return known
        adapter = load_adapter(request, self.targets, self.max_rank, self.dtype)
        with self._lock:
            return self.adapters.setdefault(request.lora_name, adapter)

    def remove(self, lora: str | int) -> bool:
        """Forget an adapter (by name or `lora_int_id`); its slot is cleared once no running
        request holds it."""
        with self._lock:
            name = (
                lora
                if isinstance(lora, str)
                else next((a.name for a in self.adapters.values() if a.request.lora_int_id == lora), "")
            )
            removed = self.adapters.pop(name, None) is not None
        for slot, held in enumerate(self.slots):
            if held == name and self._holders[slot] == 0:
                self._clear(slot)
        return removed

    def loaded(self) -> list[str]:
        with self._lock:
            return sorted(self.adapters)

    def acquire(self, name: str) -> int | None:
        """A slot holding the adapter for one more running request, loading it if needed;
        None when every slot is held by other adapters' requests."""
        self._clock += 1
        if name in self.slots:
            slot = self.slots.index(name)
        else:
            free = self._free_slot()
            if free is None:
                return None
            slot = free
            adapter = self.adapters.get(name)
            if adapter is None:
                raise InvalidParameterError("lora_request", f"adapter {name!r} is not loaded")
            self._load(slot, adapter)
        self._holders[slot] += 1
        self._last_used[slot] = self._clock
        return slot

    def release(self, slot: int) -> None:
        self._holders[slot] -= 1
        assert self._holders[slot] >= 0, f"slot {slot} released more often than acquired"
        name = self.slots[slot]
        if self._holders[slot] == 0 and name is not None and name not in self.adapters:
            self._clear(slot)  # removed while it ran

    def set_batch(self, chunk_slots: list[tuple[int | None, int]] | None) -> None:
        """Each chunk's (slot, rows) in the next forward pass, in batch order (None: the base model)."""
        self.context.batch = LoRABatch.of(chunk_slots, self.device) if chunk_slots else None

    def _free_slot(self) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        idle = [slot for slot in range(len(self.slots)) if self._holders[slot] == 0]
        return min(idle, key=lambda slot: self._last_used[slot]) if idle else None

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        if self.slots[slot] is not None:
            logger.info("LoRA slot %d: evicting %s for %s", slot, self.slots[slot], adapter.name)
        pieces: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = defaultdict(dict)
        for module, weights in adapter.weights.items():
            target = self.targets[module]
            pieces[id(target.linear)][target.segment] = weights
        for key, layer in self.layers.items():
            layer.load(slot, pieces.get(key, {}))
        self.slots[slot] = adapter.name
        self.num_loads += 1

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.clear(slot)
        self.slots[slot] = None
