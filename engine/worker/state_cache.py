"""The state cache's tensors: per state layer, every slot's convolution window (in the
model's dtype) and recurrent state (float32, as transformers keeps it: a state summed over
thousands of tokens would drift in bfloat16). Slots are handed out by the KV cache manager
(engine/core/state_slots.py); a step's chunks name theirs (`StateMetadata`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.engine.core.state_slots import StateCopy, StateLoad
from pagefleet.engine.kv_transfer.params import StateRows
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.worker.step_input import ChunkInput

StatePair = tuple[torch.Tensor, torch.Tensor]  # (conv [slots, C, K - 1], recurrent [slots, H, Dk, Dv])


@dataclass(slots=True)
class StateMetadata:
    """A step's sequences as the state layers see them, in batch order: sequence i's rows
    are query_start[i]:query_start[i + 1], from position start_positions[i]; it carries on
    from slot `slots[i]`'s state where `has_state[i]` (a later chunk, a decode), else from
    zeros (its first chunk). With `chunk_size` (the Triton path), the delta rule and Mamba-2's
    scan run their chunked forms on whole aligned chunks below `chunk_limits[i]` (the
    prompt's length rounded down to a chunk), the recurrent ones elsewhere
    (kernels/chunked_gated_delta_rule.py, kernels/chunked_selective_scan.py)."""

    query_start: torch.Tensor  # int64 [N + 1]
    slots: torch.Tensor  # int64 [N]
    has_state: torch.Tensor  # bool [N]
    start_positions: torch.Tensor  # int64 [N]
    chunk_limits: torch.Tensor  # int64 [N]
    chunk_size: int = 0  # 0: the recurrent form everywhere

    @classmethod
    def of(cls, chunks: list[ChunkInput], device: torch.device, chunk_size: int = 0) -> StateMetadata:
        starts = [0]
        for chunk in chunks:
            assert chunk.state_slot is not None, "every chunk of a state model has a slot"
            starts.append(starts[-1] + chunk.num_new_tokens)
        limits = [c.num_prompt_tokens // chunk_size * chunk_size if chunk_size else 0 for c in chunks]
        return cls(
            torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor([c.state_slot for c in chunks], dtype=torch.int64, device=device),
            torch.tensor([c.start > 0 for c in chunks], dtype=torch.bool, device=device),
            torch.tensor([c.start for c in chunks], dtype=torch.int64, device=device),
            torch.tensor(limits, dtype=torch.int64, device=device),
            chunk_size,
        )


def state_bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
    """One slot's bytes over every state layer."""
    options = config.linear_attention
    if options is None:
        return 0
    (channels, window), recurrent = options.state_shapes()
    per_layer = channels * window * dtype.itemsize + recurrent[0] * recurrent[1] * recurrent[2] * 4
    return per_layer * len(config.state_layers)


class StateCache:
    """Per state layer, its (conv, recurrent) tensors of `num_slots` rows."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        assert config.linear_attention is not None, "a model with state layers"
        conv_shape, recurrent_shape = config.linear_attention.state_shapes()
        self.num_slots = num_slots
        self.layers: dict[int, StatePair] = {
            layer: (
                torch.zeros(num_slots, *conv_shape, dtype=dtype, device=device),
                torch.zeros(num_slots, *recurrent_shape, dtype=torch.float32, device=device),
            )
            for layer in config.state_layers
        }

    def copy(self, copies: list[StateCopy], source: StateCache | None = None) -> None:
        """Each (source, destination) row copied from `source` (default: this cache; a swap's
        other side), one after the other in the list's order."""
        if not copies:
            return
        source = source or self
        for layer, (conv, recurrent) in self.layers.items():
            source_conv, source_recurrent = source.layers[layer]
            for row, target in copies:  # in order: a later copy may read what an earlier wrote
                conv[target] = source_conv[row].to(conv.device)
                recurrent[target] = source_recurrent[row].to(recurrent.device)

    def read_row(self, row: int) -> StateRows:
        """Host copies of one row of every state layer (a snapshot a connector moves out;
        any thread, for a row held so that no step rewrites it)."""
        return [(conv[row].cpu().clone(), recurrent[row].cpu().clone()) for conv, recurrent in self.layers.values()]

    def load(self, loads: list[StateLoad]) -> None:
        """Write each load's state (from outside: a pull, the file tier) into its slot."""
        for slot, rows in loads:
            for (conv, recurrent), (conv_row, recurrent_row) in zip(self.layers.values(), rows, strict=True):
                conv[slot] = conv_row.to(conv.device, conv.dtype)
                recurrent[slot] = recurrent_row.to(recurrent.device, recurrent.dtype)
