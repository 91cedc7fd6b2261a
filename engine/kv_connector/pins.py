"""The prefill side's prompts whose KV waits for a decode replica to pull it.

When a request with `do_remote_decode` finishes, its prompt's blocks are pinned (one
reference each; per KV cache group, the blocks a decode replica needs) instead of freed.
They are released when a decode replica has pulled them, or when nobody has after
`timeout` seconds, so a decode replica that never comes leaks nothing. Used only on the
engine's thread (the prefill-decode connector's state).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PinnedPrompt:
    request_id: str
    block_ids: list[list[int]]  # per KV cache group
    token_ids: list[int]  # the prompt whose KV the blocks hold
    deadline: float  # monotonic time after which the blocks are freed unpulled
    reading: bool = False  # a pull is copying the blocks now: they must not be freed under it
    state_row: int | None = None  # a model with state layers: the held snapshot after the blocks


class PinnedPrompts:
    """`free_blocks` drops a reference from blocks; `release_state` a hold on a snapshot row."""

    def __init__(
        self,
        free_blocks: Callable[[list[int]], None],
        timeout: float,
        release_state: Callable[[int], None] | None = None,
    ) -> None:
        self._free_blocks = free_blocks
        self._release_state = release_state
        self.timeout = timeout
        self._pinned: dict[str, PinnedPrompt] = {}
        self.num_timeouts = 0  # prompts freed because no decode replica pulled them in time

    @property
    def num_blocks(self) -> int:
        return sum(len(blocks) for p in self._pinned.values() for blocks in p.block_ids)

    def __len__(self) -> int:
        return len(self._pinned)

    def pin(
        self, request_id: str, block_ids: list[list[int]], token_ids: list[int], state_row: int | None = None
    ) -> None:
        """Keep `block_ids` (the caller has taken a reference on each), and the snapshot row
        it holds, for a pull."""
        deadline = time.monotonic() + self.timeout
        self._pinned[request_id] = PinnedPrompt(request_id, block_ids, token_ids, deadline, state_row=state_row)

    def checkout(self, request_id: str) -> PinnedPrompt | None:
        """The pinned prompt, marked as being read (expiry leaves it alone until `release`
        or `checkin`); None if unknown, expired or already pulled."""
        pinned = self._pinned.get(request_id)
        if pinned is None or pinned.reading:
            return None
        pinned.reading = True
        return pinned

    def checkin(self, request_id: str) -> None:
        """A pull that failed part-way: the blocks stay pinned for another try."""
        pinned = self._pinned.get(request_id)
        if pinned is not None:
            pinned.reading = False

    def release(self, request_id: str) -> bool:
        """Free the prompt's blocks (pulled, or given up); False if it was not pinned."""
        pinned = self._pinned.pop(request_id, None)
        if pinned is None:
            return False
        for blocks in pinned.block_ids:
            self._free_blocks(blocks[::-1])
        if pinned.state_row is not None and self._release_state is not None:
            self._release_state(pinned.state_row)
        return True

    def expire(self, now: float | None = None) -> int:
        """Free every prompt whose deadline passed unpulled; returns how many."""
        now = time.monotonic() if now is None else now
        expired = [p.request_id for p in self._pinned.values() if p.deadline <= now and not p.reading]
        for request_id in expired:
            logger.warning(
                "no decode replica pulled the KV of request %s in %g s; freeing it", request_id, self.timeout
            )
            self.release(request_id)
        self.num_timeouts += len(expired)
        return len(expired)
