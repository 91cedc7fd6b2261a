"""Routing policies: which replica of a model serves a request.

A policy is anything with `async choose(candidates, request) -> Route | None`. The default,
`kv`, takes the replica with the most free KV blocks after subtracting the blocks this
gateway and its peers have already promised to requests sent there since the replica last
reported (ties: fewer waiting requests). Promises live in Redis and are taken by one Lua
script, so several gateways never stampede the same replica before its next report.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import redis.asyncio as redis
from redis.exceptions import RedisError

from pagefleet.protocol.replica import ReplicaRecord

logger = logging.getLogger(__name__)

RESERVATION_PREFIX = "pagefleet:reserved:"
_RESERVATION_TTL_S = 120  # a gateway that dies mid-request cannot leak a promise for long

# KEYS: one reservation set per candidate. ARGV: amount, now, member, TTL, then per candidate:
# free blocks, waiting, report timestamp. Promises older than a replica's report are
# already in its figures and are dropped; the best candidate gets the new promise.
_RESERVE_SCRIPT = """
local amount, now, member, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local best, best_free, best_waiting = nil, nil, nil
for i, key in ipairs(KEYS) do
  local base = 4 + (i - 1) * 3
  local free, waiting, reported = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. reported)
  local promised = 0
  for _, entry in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    promised = promised + tonumber(string.match(entry, ':(%d+)$'))
  end
  local effective = free - promised
  if best == nil or effective > best_free or (effective == best_free and waiting < best_waiting) then
    best, best_free, best_waiting = i, effective, waiting
  end
end
redis.call('ZADD', KEYS[best], now, member .. ':' .. amount)
redis.call('EXPIRE', KEYS[best], ttl)
return best
"""


@dataclass(slots=True)
class RoutedRequest:
    model: str
    estimated_blocks: int  # what the request may take on the replica it goes to
    prefix: str  # the start of the prompt, for prefix affinity


Release = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


@dataclass(slots=True)
class Route:
    replica: ReplicaRecord
    release: Release = field(default=_nothing)  # drop the promise (the replica failed)


class RoutingPolicy(Protocol):
    name: str

    async def choose(self, candidates: list[ReplicaRecord], request: RoutedRequest) -> Route | None: ...


def reservation_key(record: ReplicaRecord) -> str:
    return f"{RESERVATION_PREFIX}{record.model}:{record.replica_id}"


class KVPolicy:
    name = "kv"

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._script = client.register_script(_RESERVE_SCRIPT)

    async def choose(self, candidates: list[ReplicaRecord], request: RoutedRequest) -> Route | None:
        if not candidates:
            return None
        member = uuid.uuid4().hex
        args: list[str | int | float] = [request.estimated_blocks, time.time(), member, _RESERVATION_TTL_S]
        for record in candidates:
            args += [record.free_blocks, record.waiting, record.timestamp]
        try:
            index = int(await self._script(keys=[reservation_key(r) for r in candidates], args=args)) - 1
        except (RedisError, OSError) as error:  # Redis trouble: route on the reports alone
            logger.debug("reservation failed (%s); routing without one", error)
            return Route(max(candidates, key=lambda r: (r.free_blocks, -r.waiting)))
        chosen = candidates[index]
        entry = f"{member}:{request.estimated_blocks}"

        async def release() -> None:
            try:
                await self.client.zrem(reservation_key(chosen), entry)
            except (RedisError, OSError):
                pass  # it expires with its report or its TTL

        return Route(chosen, release)


class RoundRobinPolicy:
    name = "round_robin"

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count[int]] = {}

    async def choose(self, candidates: list[ReplicaRecord], request: RoutedRequest) -> Route | None:
        if not candidates:
            return None
        ordered = sorted(candidates, key=lambda r: r.url)
        turn = next(self._counters.setdefault(request.model, itertools.count()))
        return Route(ordered[turn % len(ordered)])


class LeastRequestsPolicy:
    name = "least_requests"

    async def choose(self, candidates: list[ReplicaRecord], request: RoutedRequest) -> Route | None:
        if not candidates:
            return None
        return Route(min(candidates, key=lambda r: (r.running + r.waiting, -r.free_blocks)))


class PrefixPolicy:
    """Requests whose prompts start alike go to the same replica (rendezvous hashing on the
    prompt's start), so its prefix cache hits, unless that replica has less than
    `min_free_ratio` of the free blocks of the emptiest one."""

    name = "prefix"

    def __init__(self, min_free_ratio: float = 0.5) -> None:
        self.min_free_ratio = min_free_ratio

    async def choose(self, candidates: list[ReplicaRecord], request: RoutedRequest) -> Route | None:
        if not candidates:
            return None

        def affinity(record: ReplicaRecord) -> bytes:
            return hashlib.blake2b(f"{request.prefix}\0{record.replica_id}".encode(), digest_size=8).digest()

        preferred = max(candidates, key=affinity)
        emptiest = max(candidates, key=lambda r: r.free_blocks)
        if preferred.free_blocks < self.min_free_ratio * emptiest.free_blocks:
            return Route(emptiest)
        return Route(preferred)


POLICY_NAMES = ("kv", "round_robin", "least_requests", "prefix")


def make_policy(name: str, client: redis.Redis) -> RoutingPolicy:
    if name == "kv":
        return KVPolicy(client)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_requests":
        return LeastRequestsPolicy()
    if name == "prefix":
        return PrefixPolicy()
    raise ValueError(f"policy: unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
