"""The gateway's view of the fleet: the replica records in Redis, refreshed continuously in
the background so that routing never waits for Redis.

Records older than their TTL are dropped at each refresh. If Redis becomes unreachable the
last good view is kept for `grace` seconds, then the registry reports itself unavailable.
A model whose replicas all went away stays known for `forget_after` seconds (its requests
get 503 "retry shortly", not 404 "no such model", while it restarts), then is forgotten.

A model that may scale to zero (`pagefleet:scalable:<model>`, protocol/demand.py) is known
with no replica at all: its requests wait in `until_served` until one publishes.

LoRA adapters are models too: a request names one in `model`, and its candidates are the
replicas whose records list it. The catalog (`pagefleet:lora:<base model>`: adapter ->
path, written by the replicas that loaded one) says where an adapter no replica serves now
can be loaded from.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as redis
from pydantic import ValidationError
from redis.exceptions import RedisError

from pagefleet.protocol.demand import SCALABLE_PREFIX
from pagefleet.protocol.replica import CATALOG_PREFIX, ReplicaRecord, model_pattern

logger = logging.getLogger(__name__)


class ReplicaRegistry:
    def __init__(
        self, client: redis.Redis, refresh_interval: float, ttl: float, grace: float, forget_after: float = 600.0
    ) -> None:
        self.client = client
        self.refresh_interval, self.ttl, self.grace, self.forget_after = refresh_interval, ttl, grace, forget_after
        self.by_model: dict[str, list[ReplicaRecord]] = {}
        self.by_adapter: dict[str, list[ReplicaRecord]] = {}
        self.catalog: dict[str, tuple[str, str]] = {}  # adapter -> (base model, its path)
        self._last_seen: dict[str, float] = {}  # model -> monotonic time it last had a replica
        self.last_refresh: float | None = None  # monotonic time of the last good refresh
        self._excluded: dict[str, float] = {}  # replica url -> monotonic time it may be used again
        self._redis_down = False
        self.scalable: set[str] = set()  # models that may have no replica (scaled to zero)
        self._served: dict[str, asyncio.Event] = {}  # model -> set once a replica of it publishes
        # The last refresh's records by their raw value: a replica reports every half second,
        # a refresh comes every 0.2 s, so most records are parsed already (128 a refresh at 128).
        self._parsed: dict[bytes | str, ReplicaRecord] = {}

    async def refresh(self) -> None:
        keys = [key async for key in self.client.scan_iter(match=model_pattern(), count=1000)]
        values = await self.client.mget(keys) if keys else []
        now = time.time()
        by_model: dict[str, list[ReplicaRecord]] = {}
        parsed: dict[bytes | str, ReplicaRecord] = {}
        for value in values:
            if value is None:  # expired between SCAN and MGET
                continue
            record = self._parsed.get(value)
            if record is None:
                try:
                    record = ReplicaRecord.model_validate_json(value)
                except ValidationError:
                    logger.warning("ignoring a malformed replica record")
                    continue
            parsed[value] = record
            if record.is_fresh(now, self.ttl):
                by_model.setdefault(record.model, []).append(record)
        by_adapter: dict[str, list[ReplicaRecord]] = {}
        for records in by_model.values():
            for record in records:
                for adapter in record.adapters:
                    by_adapter.setdefault(adapter, []).append(record)
        self.by_model, self.by_adapter, self._parsed = by_model, by_adapter, parsed
        self.catalog = await self._read_catalog()
        self.scalable = {
            (key.decode() if isinstance(key, bytes) else key).removeprefix(SCALABLE_PREFIX)
            async for key in self.client.scan_iter(match=f"{SCALABLE_PREFIX}*", count=1000)
        }
        for model in [m for m in self._served if by_model.get(m)]:
            self._served.pop(model).set()  # the held requests go, in the order they came
        self.last_refresh = time.monotonic()
        self._last_seen.update(dict.fromkeys(by_model, self.last_refresh))
        forgotten = [m for m, seen in self._last_seen.items() if self.last_refresh - seen > self.forget_after]
        for model in forgotten:
            del self._last_seen[model]

    async def _read_catalog(self) -> dict[str, tuple[str, str]]:
        keys = [key async for key in self.client.scan_iter(match=f"{CATALOG_PREFIX}*", count=1000)]
        catalog = {}
        for key in keys:
            base = (key.decode() if isinstance(key, bytes) else key).removeprefix(CATALOG_PREFIX)
            entries: dict[bytes, bytes] = await self.client.hgetall(key)  # type: ignore[assignment]
            for name, path in entries.items():
                catalog[name.decode()] = (base, path.decode())
        return catalog

    async def run(self) -> None:
        """Refresh until cancelled; Redis errors are logged once per outage."""
        while True:
            try:
                await self.refresh()
                if self._redis_down:
                    logger.info("Redis is reachable again")
                self._redis_down = False
            except (RedisError, OSError) as error:
                if not self._redis_down:
                    logger.warning("cannot read replicas from Redis (%s); routing on the last view", error)
                self._redis_down = True
            await asyncio.sleep(self.refresh_interval)

    @property
    def is_available(self) -> bool:
        return self.last_refresh is not None and time.monotonic() - self.last_refresh <= self.grace

    def models(self) -> list[str]:
        """The base models and the adapters served now, and the models scaled to zero."""
        served = {model for model, records in (self.by_model | self.by_adapter).items() if records}
        return sorted(served | self.scalable)

    def parent(self, model: str) -> str | None:
        """The base model of an adapter (None for a base model)."""
        if model in self.by_model:
            return None
        records = self.by_adapter.get(model)
        if records:
            return records[0].model
        known = self.catalog.get(model)
        return known[0] if known else None

    def unserved_adapter(self, model: str) -> tuple[str, str] | None:
        """(base model, path) of an adapter in the catalog that no live replica serves."""
        if self.by_adapter.get(model) or model in self.by_model:
            return None
        return self.catalog.get(model)

    def note_adapter(self, url: str, adapter: str) -> None:
        """A replica just loaded `adapter` (its next report will say so too)."""
        for records in self.by_model.values():
            for record in records:
                if record.url == url and adapter not in record.adapters:
                    record.adapters.append(adapter)
                    self.by_adapter.setdefault(adapter, []).append(record)

    def is_known(self, model: str) -> bool:
        """Served now, or lately enough that it is likely coming back; one that may scale to
        zero; or an adapter served now or in the catalog."""
        return (
            model in self._last_seen
            or model in self.scalable
            or bool(self.by_adapter.get(model))
            or model in self.catalog
        )

    def is_scaled_to_zero(self, model: str) -> bool:
        """A model that may scale to zero and has no live replica now."""
        return model in self.scalable and not self.by_model.get(model)

    async def until_served(self, model: str, timeout: float) -> bool:
        """Wait until a replica of `model` publishes (callers resume in the order they
        came); False after `timeout` seconds."""
        if self.by_model.get(model):
            return True
        served = self._served.setdefault(model, asyncio.Event())
        try:
            await asyncio.wait_for(served.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def candidates(self, model: str, skip: set[str] = frozenset()) -> list[ReplicaRecord]:  # type: ignore[assignment]
        now = time.monotonic()
        return [
            record
            for record in self.by_model.get(model) or self.by_adapter.get(model, [])
            if record.url not in skip and self._excluded.get(record.url, 0.0) <= now
        ]

    def exclude(self, url: str, seconds: float) -> None:
        """Skip a replica that just failed, until its next chance."""
        self._excluded[url] = time.monotonic() + seconds
