"""Publishes this replica's KV capacity to Redis (the record of protocol/replica.py).

The record is refreshed every `publish_interval` seconds, and at once when free blocks or
the queue move a lot, with a TTL so that a dead replica vanishes by itself. The prefix
cache's changes go to the fleet's index (kv_events.py) at every poll, within `_POLL_S`. Redis being
down never stops serving: the failure is logged once, and publication resumes by itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as redis
from redis.exceptions import RedisError

from pagefleet.engine.front.stats import EngineStats, KVEvent
from pagefleet.engine.server.kv_events import KVEventPublisher
from pagefleet.protocol.replica import ReplicaRecord, catalog_key, record_key

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often a large change is looked for between regular refreshes
_LARGE_CHANGE = 0.1  # of the total blocks


class CapacityPublisher:
    def __init__(
        self,
        redis_url: str,
        model_name: str,
        replica_id: str,
        url: str,
        max_model_len: int,
        read_stats: Callable[[], EngineStats],
        interval: float,
        ttl: float,
        restarts: int = 0,
        role: str = "both",
        adapters: Callable[[], dict[str, str]] = dict,
        take_kv_events: Callable[[], list[KVEvent]] | None = None,
    ) -> None:
        self.client = redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.kv_events = (
            KVEventPublisher(self.client, model_name, replica_id, take_kv_events, ttl) if take_kv_events else None
        )
        self.key = record_key(model_name, replica_id)
        self.model_name, self.replica_id, self.url = model_name, replica_id, url
        self.max_model_len = max_model_len
        self.read_stats = read_stats
        self.interval, self.ttl = interval, ttl
        self.restarts = restarts
        self.role = role
        self.adapters = adapters
        self._catalogued: dict[str, str] = {}
        self._last: EngineStats | None = None
        self._last_time = 0.0
        self._redis_down = False

    def record(self, stats: EngineStats) -> ReplicaRecord:
        return ReplicaRecord(
            replica_id=self.replica_id,
            model=self.model_name,
            url=self.url,
            free_blocks=stats.num_free_blocks,
            free_tokens=stats.num_free_tokens,
            total_blocks=stats.num_total_blocks,
            block_size=stats.block_size,
            running=stats.num_running_requests,
            waiting=stats.num_waiting_requests,
            max_model_len=self.max_model_len,
            restarts=self.restarts,
            role=self.role,
            waiting_prompt_tokens=stats.num_waiting_prompt_tokens,
            prefill_tokens_per_s=round(stats.prefill_tokens_per_s, 1),
            adapters=sorted(self.adapters()),
            free_state_slots=stats.num_free_state_slots if stats.num_state_slots else None,
            total_state_slots=stats.num_state_slots or None,
        )

    async def run(self) -> None:
        """Publish until cancelled."""
        while True:
            stats = self.read_stats()
            if time.monotonic() - self._last_time >= self.interval or self._changed_a_lot(stats):
                await self.publish(stats)
            elif self.kv_events is not None and not self._redis_down:
                await self._write(self.kv_events.flush(refresh_ttl=False))
            await asyncio.sleep(_POLL_S)

    def _changed_a_lot(self, stats: EngineStats) -> bool:
        last = self._last
        if last is None:
            return True
        moved = abs(stats.num_free_blocks - last.num_free_blocks)
        return moved >= _LARGE_CHANGE * stats.num_total_blocks or (stats.num_waiting_requests > 0) != (
            last.num_waiting_requests > 0
        )

    async def publish(self, stats: EngineStats) -> None:
        self._last, self._last_time = stats, time.monotonic()
        await self._write(self._publish(stats))

    async def _publish(self, stats: EngineStats) -> None:
        await self.client.set(self.key, self.record(stats).model_dump_json(), px=int(self.ttl * 1000))
        if self.kv_events is not None:
            await self.kv_events.flush(refresh_ttl=True)
        await self._catalogue()

    async def _write(self, writing: Awaitable[None]) -> None:
        """Run one write to Redis; a failure is logged once per outage, never raised."""
        try:
            await writing
        except (RedisError, OSError) as error:
            if not self._redis_down:
                logger.warning("cannot publish to Redis (%s); serving on, will retry", error)
            self._redis_down = True
            return
        if self._redis_down:
            logger.info("Redis is reachable again; publishing")
        self._redis_down = False

    async def _catalogue(self) -> None:
        """Record new adapters' sources in the fleet's catalog (protocol/replica.py), so a
        gateway can load them on another replica of this model."""
        adapters = self.adapters()
        new = {name: path for name, path in adapters.items() if self._catalogued.get(name) != path}
        if new:
            await self.client.hset(catalog_key(self.model_name), mapping=dict[Any, Any](new))
            self._catalogued.update(new)

    async def remove(self) -> None:
        """Delete the record and the prefix index entries (graceful shutdown); best effort."""
        try:
            await self.client.delete(self.key)
            if self.kv_events is not None:
                await self.kv_events.remove()
        except (RedisError, OSError) as error:
            logger.warning("could not remove %s from Redis: %s", self.key, error)
        finally:
            await self.client.aclose()
