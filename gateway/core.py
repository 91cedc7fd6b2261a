"""The parts every router of the fleet runs, the gateway and the picker alike: one Redis
client, the registry of replicas refreshed in the background, admission and routing."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as redis
from redis.exceptions import RedisError

from pagefleet.gateway.admission import Admission
from pagefleet.gateway.limits import RateLimiter
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.routing import Router
from pagefleet.gateway.settings import RoutingSettings

logger = logging.getLogger(__name__)


class RoutingCore:
    def __init__(self, settings: RoutingSettings, metrics: GatewayMetrics) -> None:
        self.client = redis.from_url(settings.redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self.registry = ReplicaRegistry(
            self.client,
            settings.refresh_interval_s,
            settings.record_ttl_s,
            settings.redis_grace_s,
            settings.forget_model_after_s,
        )
        limiter = RateLimiter(self.client, settings.requests_per_minute, settings.tokens_per_minute)
        self.admission = Admission(settings.keys(), self.registry, limiter, metrics)
        self.router = Router.from_names(self.registry, self.client, settings.policy, settings.model_policies, metrics)
        self._refreshing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """A first view of the replicas if Redis is up (else the registry keeps trying), then
        refreshes in the background."""
        try:
            await self.registry.refresh()
        except (RedisError, OSError) as error:
            logger.warning("no view of the replicas yet (%s); the registry retries in the background", error)
        self._refreshing = asyncio.create_task(self.registry.run())

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        await self.client.aclose()
