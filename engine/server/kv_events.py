"""Publishes this replica's prefix-cache contents to the fleet's index in Redis
(protocol/prefix_index.py), so routers know exactly which replica holds which prefix.

The engine's step thread only appends events to a queue (engine/core/block_pool.py); this class
takes them from the server's event loop, nets each batch (a hash stored and removed within
one batch is not sent), and writes the batch in one transaction: the replica's SET and one
STREAM entry. It keeps its own copy of what it has published, so that after Redis was
unreachable it can start over with a `reset` entry and a full set instead of a gap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis.asyncio as redis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from pagefleet.engine.front.stats import KVEvent
from pagefleet.protocol.block_hash import pack
from pagefleet.protocol.prefix_index import STREAM_MAX_ENTRIES, blocks_key, events_key

logger = logging.getLogger(__name__)


def set_members(hashes: set[int]) -> list[bytes]:
    """Each hash as its own SET member (8 bytes, as protocol/block_hash.pack writes them)."""
    return [pack([h]) for h in hashes]


class KVEventPublisher:
    """Args:
    client: the replica's Redis client (shared with the capacity publisher).
    model_name, replica_id: whose index this is.
    take_events: the engine's queued events, oldest first (`AsyncEngine.take_kv_events`).
    ttl: seconds the SET lives without a refresh (the replica record's TTL).
    """

    def __init__(
        self,
        client: redis.Redis,
        model_name: str,
        replica_id: str,
        take_events: Callable[[], list[KVEvent]],
        ttl: float,
    ) -> None:
        self.client, self.replica_id = client, replica_id
        self.take_events, self.ttl_ms = take_events, int(ttl * 1000)
        self.set_key, self.stream_key = blocks_key(model_name, replica_id), events_key(model_name)
        self.held: set[int] = set()  # what the engine's cache holds, as far as events said
        self._in_sync = False  # Redis has `held` exactly (False at start and after a failure)

    def _apply(self, events: list[KVEvent]) -> tuple[set[int], set[int]]:
        """Fold events into `held`; the batch's net (stored, removed)."""
        before: dict[int, bool] = {}  # hash -> held before this batch
        for event in events:
            before.setdefault(event.block_hash, event.block_hash in self.held)
            if event.stored:
                self.held.add(event.block_hash)
            else:
                self.held.discard(event.block_hash)
        stored = {h for h, was in before.items() if not was and h in self.held}
        removed = {h for h, was in before.items() if was and h not in self.held}
        return stored, removed

    async def flush(self, refresh_ttl: bool) -> None:
        """Send what changed since the last flush (everything, after a failure). Raises
        RedisError or OSError; the next flush then starts over."""
        stored, removed = self._apply(self.take_events())
        if self._in_sync and not stored and not removed and not refresh_ttl:
            return
        pipe = self.client.pipeline(transaction=True)
        entry: dict[FieldT, EncodableT] = {"replica": self.replica_id}
        if not self._in_sync:
            pipe.delete(self.set_key)
            stored, removed = set(self.held), set()
            entry["reset"] = "1"
        if stored:
            pipe.sadd(self.set_key, *set_members(stored))
            entry["stored"] = pack(sorted(stored))
        if removed:
            pipe.srem(self.set_key, *set_members(removed))
            entry["removed"] = pack(sorted(removed))
        if len(entry) > 1:
            pipe.xadd(self.stream_key, entry, maxlen=STREAM_MAX_ENTRIES, approximate=True)
        pipe.pexpire(self.set_key, self.ttl_ms)  # last: its answer says whether the SET still exists
        self._in_sync = False  # until the transaction is known to have gone through
        refreshed = (await pipe.execute())[-1]
        # The SET expired (this process stalled past its TTL): the next flush starts over.
        self._in_sync = refreshed or not self.held

    async def remove(self) -> None:
        """Withdraw everything this replica published (graceful shutdown); best effort."""
        try:
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(self.set_key)
            entry: dict[FieldT, EncodableT] = {"replica": self.replica_id, "reset": "1"}
            pipe.xadd(self.stream_key, entry, maxlen=STREAM_MAX_ENTRIES, approximate=True)
            await pipe.execute()
        except (RedisError, OSError) as error:
            logger.warning("could not withdraw %s from the prefix index: %s", self.set_key, error)
