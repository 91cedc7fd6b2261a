"""The gateway's copy of the fleet's prefix index: which live replica holds which
prefix-cache block (protocol/prefix_index.py says how replicas publish it).

A background task reads each model's snapshot SETs once (and again every `resync_s`, which
also covers entries the capped stream dropped while this gateway lagged), then follows the
model's event stream. Lookups are in memory: routing never waits for Redis. Replicas are
kept by id and counted only while they are candidates (a live record), so a replica that
died stops counting when its record expires, and is forgotten at the next refresh.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from typing import Any

import redis.asyncio as redis
from redis.exceptions import RedisError

from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.protocol.block_hash import state_snapshot_hash, unpack
from pagefleet.protocol.prefix_index import blocks_key, events_key

logger = logging.getLogger(__name__)

_READ_BLOCK_MS = 200
_READ_COUNT = 1000


class ModelIndex:
    """One model's blocks: hash -> replica ids holding it, and the inverse."""

    def __init__(self) -> None:
        self.holders: dict[int, set[str]] = {}
        self.held: dict[str, set[int]] = {}
        self.last_id = b"0-0"  # the last stream entry applied
        self.heard_at: dict[str, float] = {}  # replica id -> monotonic time of its last entry

    def store(self, replica_id: str, hashes: list[int]) -> None:
        self.held.setdefault(replica_id, set()).update(hashes)
        for block_hash in hashes:
            self.holders.setdefault(block_hash, set()).add(replica_id)

    def remove(self, replica_id: str, hashes: list[int]) -> None:
        held = self.held.get(replica_id)
        for block_hash in hashes:
            if held is not None:
                held.discard(block_hash)
            owners = self.holders.get(block_hash)
            if owners is not None:
                owners.discard(replica_id)
                if not owners:
                    del self.holders[block_hash]

    def forget(self, replica_id: str) -> None:
        self.remove(replica_id, list(self.held.pop(replica_id, ())))
        self.heard_at.pop(replica_id, None)

    def apply(self, fields: dict[bytes, bytes]) -> None:
        """One stream entry (protocol/prefix_index.py)."""
        replica_id = fields.get(b"replica", b"").decode()
        self.heard_at[replica_id] = time.monotonic()
        if fields.get(b"reset") == b"1":
            self.forget(replica_id)
        if b"removed" in fields:
            self.remove(replica_id, unpack(fields[b"removed"]))
        if b"stored" in fields:
            self.store(replica_id, unpack(fields[b"stored"]))

    def matched_blocks(
        self, block_hashes: list[int], replica_ids: list[str], with_state: frozenset[str] = frozenset()
    ) -> dict[str, int]:
        """How many of the leading `block_hashes` each replica holds (its cached prefix);
        for replicas of a model with state layers (`with_state`), only as far as one holds
        the state snapshot after the prefix's last block too."""
        matched = leading_depths(block_hashes, replica_ids, self.holders)
        for replica_id in with_state & matched.keys():
            held = self.held.get(replica_id, set())
            depth = matched[replica_id]
            while depth and state_snapshot_hash(block_hashes[depth - 1]) not in held:
                depth -= 1
            matched[replica_id] = depth
        return matched


def leading_depths(
    block_hashes: list[int], replica_ids: list[str], holders: Mapping[int, Collection[str]]
) -> dict[str, int]:
    """Per replica, how many of the leading `block_hashes` `holders` says it holds. A replica's
    depth is written once, when it drops out: a shared prefix of hundreds of blocks held by a
    few replicas costs one membership test per holder and block."""
    matched = dict.fromkeys(replica_ids, 0)
    alive = set(replica_ids)
    depth = 0
    for block_hash in block_hashes:
        holding = holders.get(block_hash, ())
        if not alive.issubset(holding):
            for replica_id in alive.difference(holding):
                matched[replica_id] = depth
            alive.intersection_update(holding)
            if not alive:
                return matched
        depth += 1
    for replica_id in alive:
        matched[replica_id] = depth
    return matched


class PrefixIndex:
    """Args:
    client: the router's Redis client.
    registry: the live replicas (only theirs count).
    resync_s: how often every snapshot is read again.
    """

    def __init__(self, client: redis.Redis, registry: ReplicaRegistry, resync_s: float = 30.0) -> None:
        self.client, self.registry, self.resync_s = client, registry, resync_s
        self.models: dict[str, ModelIndex] = {}
        self._synced_at: dict[str, float] = {}
        self._redis_down = False

    def matched_blocks(
        self, model: str, block_hashes: list[int], replica_ids: list[str], with_state: frozenset[str] = frozenset()
    ) -> dict[str, int]:
        """Per replica, its cached prefix of `block_hashes` in blocks (0 for every replica
        while nothing is known of the model); `with_state`: see ModelIndex.matched_blocks."""
        index = self.models.get(model)
        if index is None:
            return dict.fromkeys(replica_ids, 0)
        return index.matched_blocks(block_hashes, replica_ids, with_state)

    def num_blocks(self, model: str) -> int:
        """Distinct blocks the model's replicas hold, as far as this index knows."""
        index = self.models.get(model)
        return len(index.holders) if index is not None else 0

    async def run(self) -> None:
        """Follow the index until cancelled; Redis errors are logged once per outage."""
        while True:
            try:
                await self.refresh()
                if self._redis_down:
                    logger.info("prefix index: Redis is reachable again")
                self._redis_down = False
            except (RedisError, OSError) as error:
                if not self._redis_down:
                    logger.warning("prefix index: cannot read Redis (%s); routing on what it knew", error)
                self._redis_down = True
                await asyncio.sleep(_READ_BLOCK_MS / 1000)

    async def refresh(self) -> None:
        """Snapshot the models that need it, drop replicas that left, then apply the events
        that arrive within `_READ_BLOCK_MS`."""
        now = time.monotonic()
        for model in list(self.registry.by_model):
            if now - self._synced_at.get(model, -self.resync_s) >= self.resync_s:
                await self._snapshot(model)
                self._synced_at[model] = now
        if self.registry.is_available:
            self._forget_departed()
        if not self.models:
            await asyncio.sleep(_READ_BLOCK_MS / 1000)
            return
        streams: dict[Any, Any] = {events_key(model): index.last_id for model, index in self.models.items()}
        answer: list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] = await self.client.xread(  # type: ignore[assignment]
            streams, count=_READ_COUNT, block=_READ_BLOCK_MS
        )
        for key, entries in answer or []:
            model = key.decode().removeprefix(events_key(""))
            index = self.models[model]
            for entry_id, fields in entries:
                index.apply(fields)
                index.last_id = entry_id

    async def _snapshot(self, model: str) -> None:
        """Rebuild the model's index from its replicas' SETs, then follow its stream from
        the entry that was last when the SETs were read (replaying is harmless)."""
        latest: list[tuple[bytes, dict[bytes, bytes]]] = await self.client.xrevrange(  # type: ignore[assignment]
            events_key(model), count=1
        )
        index = ModelIndex()
        index.last_id = latest[0][0] if latest else b"0-0"
        replicas = [record.replica_id for record in self.registry.by_model.get(model, [])]
        pipe = self.client.pipeline(transaction=False)
        for replica_id in replicas:
            pipe.smembers(blocks_key(model, replica_id))
        for replica_id, members in zip(replicas, await pipe.execute(), strict=True):
            index.store(replica_id, unpack(b"".join(members)))
        self.models[model] = index

    def _forget_departed(self) -> None:
        """Drop replicas without a live record that have said nothing for a record's TTL (a
        new replica's first entries may arrive before its record is seen)."""
        quiet_since = time.monotonic() - self.registry.ttl
        for model, index in self.models.items():
            live = {record.replica_id for record in self.registry.by_model.get(model, [])}
            for replica_id in [r for r in index.held if r not in live]:
                if index.heard_at.get(replica_id, 0.0) < quiet_since:
                    index.forget(replica_id)
