"""Promises of KV blocks made in Redis, shared by every gateway and picker, so that several
routers never stampede the same replica before its next report.

Per replica, a sorted set holds the promises (member `id:blocks`, scored by the time they
were made) and a counter holds their sum, so that choosing costs the same however many
promises are outstanding. Promises older than the replica's report are already in its
figures: the script drops them (and takes them off the sum) before comparing. One script
call per request both reads the sums and makes the new promise, atomically.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import redis.asyncio as redis

from pagefleet.gateway.decision import Candidate
from pagefleet.protocol.replica import ReplicaRecord

RESERVATION_PREFIX = "pagefleet:reserved:"
RESERVATION_TTL_S = 120  # a router that dies mid-request cannot leak a promise for long

# KEYS: per candidate, its promise set then its sum. ARGV: blocks, now, member (`id:blocks`), TTL, then
# per candidate: free blocks, queued prompt tokens, report timestamp. Returns the 1-based
# candidate: the most free blocks net of promises, then the shortest queue (the fleet's one
# ranking by load, decision.Candidate.load_rank, with the promises Redis holds).
_RESERVE = """
local amount, now, member, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local best, best_free, best_queued = nil, nil, nil
for c = 1, #KEYS / 2 do
  local promises, total = KEYS[2 * c - 1], KEYS[2 * c]
  local base = 4 + (c - 1) * 3
  local free, queued, reported = tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3])
  local promised = tonumber(redis.call('GET', total) or '0')
  local stale = redis.call('ZRANGEBYSCORE', promises, '-inf', '(' .. reported)
  if #stale > 0 then
    local dropped = 0
    for _, entry in ipairs(stale) do
      dropped = dropped + tonumber(string.match(entry, ':(%d+)$'))
    end
    redis.call('ZREMRANGEBYSCORE', promises, '-inf', '(' .. reported)
    promised = redis.call('DECRBY', total, dropped)
  end
  if promised < 0 then  -- the set and its sum expired apart: trust the set
    promised = 0
    redis.call('DEL', total)
  end
  local effective = free - promised
  if best == nil or effective > best_free or (effective == best_free and queued < best_queued) then
    best, best_free, best_queued = c, effective, queued
  end
end
local promises, total = KEYS[2 * best - 1], KEYS[2 * best]
redis.call('ZADD', promises, now, member)
redis.call('INCRBY', total, amount)
redis.call('EXPIRE', promises, ttl)
redis.call('EXPIRE', total, ttl)
return best
"""

# KEYS: the promise set and its sum. ARGV: the member. A promise already dropped (the
# replica reported since) is not taken off twice.
_RELEASE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  redis.call('DECRBY', KEYS[2], tonumber(string.match(ARGV[1], ':(%d+)$')))
end
return 0
"""


def promise_keys(record: ReplicaRecord) -> tuple[str, str]:
    key = f"{RESERVATION_PREFIX}{record.model}:{record.replica_id}"
    return key, key + ":sum"


@dataclass(slots=True, frozen=True)
class Promise:
    replica: ReplicaRecord
    member: str


class Reservations:
    def __init__(self, client: redis.Redis) -> None:
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)

    async def reserve(self, candidates: list[ReplicaRecord], blocks: int) -> Promise:
        """Promise `blocks` on the candidate with the most free blocks net of promises (ties:
        the shorter prompt queue). Raises RedisError or OSError when Redis cannot be asked."""
        member = f"{os.urandom(8).hex()}:{blocks}"
        args: list[str | int | float] = [blocks, time.time(), member, RESERVATION_TTL_S]
        keys: list[str] = []
        for record in candidates:
            args += [record.room_blocks, Candidate(record).queued_prompt_tokens, record.timestamp]
            keys += promise_keys(record)
        index = int(await self._reserve(keys=keys, args=args)) - 1
        return Promise(candidates[index], member)

    async def release(self, promise: Promise) -> None:
        await self._release(keys=list(promise_keys(promise.replica)), args=[promise.member])
