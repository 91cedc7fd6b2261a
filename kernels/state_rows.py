"""The torch references' walk over a flat batch of sequences with state slots, shared by
the token-by-token recurrences (gated_delta_rule.py, selective_scan.py).

Sequences go longest first, so those with a row at position `step` are a prefix and their
states one contiguous tensor [n, ...]; a finished sequence's state is written back to its
slot as the prefix shrinks past it. Each sequence's rows see the same ops whatever the
batch, which is what keeps a token's state the same bits however its prompt is split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def recur_by_rows(
    state: torch.Tensor,
    query_start: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """Run `step(recurrent [n, ...], rows [n])` -> the next recurrent state, once per position,
    over the sequences that have a row there (the step writes its own outputs); every
    sequence starts from its slot's state where `has_state`, else zeros, and ends in it."""
    starts, lengths = query_start[:-1].tolist(), (query_start[1:] - query_start[:-1]).tolist()
    order = sorted(range(len(lengths)), key=lambda sequence: -lengths[sequence])
    order_index = torch.tensor(order, dtype=torch.int64, device=state.device)
    sorted_starts = torch.tensor([starts[i] for i in order], dtype=torch.int64, device=state.device)
    sorted_slots = slots.long()[order_index]
    recurrent = torch.where(has_state[order_index, None, None, None], state[sorted_slots], 0.0)
    for position in range(max(lengths, default=0) + 1):
        num_active = sum(lengths[i] > position for i in order)
        if num_active < recurrent.shape[0]:
            state[sorted_slots[num_active : recurrent.shape[0]]] = recurrent[num_active:]
            recurrent = recurrent[:num_active]
        if num_active == 0:
            break
        recurrent = step(recurrent, sorted_starts[:num_active] + position)
