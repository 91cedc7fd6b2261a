"""API keys and per-key rate limits (requests and tokens per minute), counted in Redis so
that every gateway replica enforces one limit. Keys are never logged: Redis and the logs
see only a short hash of each."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import redis.asyncio as redis
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

RATE_PREFIX = "pagefleet:ratelimit:"


def key_id(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


@dataclass(slots=True)
class Verdict:
    allowed: bool
    retry_after: int = 0  # seconds, when refused
    reason: str = ""


class RateLimiter:
    """Fixed one-minute windows: INCRBY on a key per (api key, minute), expiring after it."""

    def __init__(self, client: redis.Redis, requests_per_minute: int, tokens_per_minute: int) -> None:
        self.client = client
        self.requests_per_minute, self.tokens_per_minute = requests_per_minute, tokens_per_minute

    @property
    def enabled(self) -> bool:
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0

    async def check(self, api_key: str, tokens: int) -> Verdict:
        if not self.enabled:
            return Verdict(True)
        now = time.time()
        minute = int(now // 60)
        retry_after = max(1, int(60 - now % 60))
        base = f"{RATE_PREFIX}{key_id(api_key)}:{minute}"
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.incrby(f"{base}:requests", 1)
                pipe.expire(f"{base}:requests", 120)
                pipe.incrby(f"{base}:tokens", tokens)
                pipe.expire(f"{base}:tokens", 120)
                requests, _, used_tokens, _ = await pipe.execute()
        except (RedisError, OSError) as error:  # fail open: Redis trouble must not stop traffic
            logger.warning("rate limits not enforced, Redis unreachable: %s", error)
            return Verdict(True)
        if self.requests_per_minute and requests > self.requests_per_minute:
            return Verdict(False, retry_after, f"more than {self.requests_per_minute} requests per minute")
        if self.tokens_per_minute and used_tokens > self.tokens_per_minute:
            return Verdict(False, retry_after, f"more than {self.tokens_per_minute} tokens per minute")
        return Verdict(True)
