"""Stored responses of the Responses API (`store: true`), where every replica and gateway
can read them: Redis, one JSON value per response under `pagefleet:response:<id>` with a
TTL (documented in docs/redis-protocol.md). A server without Redis keeps them in its own
memory, bounded in count and age.

Each record holds the public response object (what `GET /v1/responses/{id}` returns), the
conversation up to and including its answer as chat messages (what a follow-up through
`previous_response_id` continues, on any replica) and the URL of the replica that ran it
(where a cancel of a background response must go).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Protocol

import redis.asyncio as redis
from pydantic import BaseModel, Field
from redis.exceptions import RedisError

KEY_PREFIX = "pagefleet:response:"
DEFAULT_TTL_S = 24 * 3600.0
MAX_IN_MEMORY = 10_000  # a lone server's stored responses; the oldest go first


class StoreUnavailable(Exception):
    """The shared store could not be reached."""


class StoredResponse(BaseModel):
    response: dict[str, Any] = Field(description="the response object, as GET /v1/responses/{id} returns it")
    conversation: list[dict[str, Any]] = Field(
        description="chat messages up to and including this response's output; instructions are not kept"
    )
    input_items: list[dict[str, Any]] = Field(default_factory=list, description="this request's input items")
    replica_url: str | None = Field(None, description="the replica that runs or ran it")

    @property
    def response_id(self) -> str:
        return str(self.response["id"])

    @property
    def is_running(self) -> bool:
        return self.response.get("status") in ("queued", "in_progress")


class ResponseStore(Protocol):
    async def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None if there is none (never stored, deleted or expired)."""

    async def put(self, record: StoredResponse, replace_only: bool = False) -> bool:
        """Store `record`; with `replace_only`, only if it is still there (a deleted
        response is not brought back by its late answer), keeping its expiry. True if it
        was written."""

    async def delete(self, response_id: str) -> bool:
        """True if there was a record to delete."""

    async def close(self) -> None: ...


class RedisResponseStore:
    def __init__(self, client: redis.Redis, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.client, self.ttl_ms = client, int(ttl_s * 1000)

    @classmethod
    def from_url(cls, url: str, ttl_s: float = DEFAULT_TTL_S) -> RedisResponseStore:
        return cls(redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0), ttl_s)

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            raw = await self.client.get(KEY_PREFIX + response_id)
        except (RedisError, OSError) as error:
            raise StoreUnavailable(str(error)) from error
        return StoredResponse.model_validate_json(raw) if raw is not None else None

    async def put(self, record: StoredResponse, replace_only: bool = False) -> bool:
        try:
            key, value = KEY_PREFIX + record.response_id, record.model_dump_json()
            if replace_only:  # its age counts from when it was created
                written = await self.client.set(key, value, xx=True, keepttl=True)
            else:
                written = await self.client.set(key, value, px=self.ttl_ms)
        except (RedisError, OSError) as error:
            raise StoreUnavailable(str(error)) from error
        return bool(written)

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self.client.delete(KEY_PREFIX + response_id))
        except (RedisError, OSError) as error:
            raise StoreUnavailable(str(error)) from error

    async def close(self) -> None:
        await self.client.aclose()


class MemoryResponseStore:
    """This process's records, for a server with no Redis: at most `max_records`, each for
    `ttl_s` seconds."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_records: int = MAX_IN_MEMORY) -> None:
        self.ttl_s, self.max_records = ttl_s, max_records
        self._records: OrderedDict[str, tuple[float, str]] = OrderedDict()  # id -> (expiry, JSON)

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._records.get(response_id)
        if entry is None or entry[0] < time.monotonic():
            self._records.pop(response_id, None)
            return None
        return StoredResponse.model_validate_json(entry[1])

    async def put(self, record: StoredResponse, replace_only: bool = False) -> bool:
        expiry = time.monotonic() + self.ttl_s
        if replace_only:
            if await self.get(record.response_id) is None:
                return False
            expiry = self._records[record.response_id][0]
        self._records[record.response_id] = (expiry, record.model_dump_json())
        self._records.move_to_end(record.response_id)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)
        return True

    async def delete(self, response_id: str) -> bool:
        return self._records.pop(response_id, None) is not None

    async def close(self) -> None:
        self._records.clear()
