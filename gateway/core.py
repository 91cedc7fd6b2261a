"""The parts every router of the fleet runs, the gateway and the picker alike: one Redis
client, the registry of replicas and the fleet's prefix index followed in the background,
admission and routing, and the director that runs each request through them."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as redis
from redis.exceptions import RedisError

from pagefleet.gateway.admission import Admission
from pagefleet.gateway.director import Director
from pagefleet.gateway.limits import RateLimiter
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.prefix_index import PrefixIndex
from pagefleet.gateway.prompt_hashes import PromptHashers
from pagefleet.gateway.proxy import OutlierDetector
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.routing import PrefixRouting, Router
from pagefleet.gateway.settings import RoutingSettings
from pagefleet.gateway.tracing import ProxyTracing
from pagefleet.gateway.upstream import UpstreamPool
from pagefleet.protocol.demand import DemandSignal
from pagefleet.runtime.response_store import RedisResponseStore

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
        demand = DemandSignal(self.client)
        self.admission = Admission(
            settings.keys(),
            self.registry,
            limiter,
            metrics,
            demand,
            settings.hold_timeout_s,
            settings.hold_max_requests,
        )
        self.prefix_index = PrefixIndex(self.client, self.registry)
        self.responses = RedisResponseStore(self.client)  # read to route a follow-up to its conversation
        self.hashers = PromptHashers(on_ready=lambda model: metrics.prefix_routing_ready.labels(model).set(1))
        prefixes = PrefixRouting(self.hashers, self.prefix_index, settings.saturation_s)
        self.router = Router.from_names(
            self.registry, self.client, settings.policy, settings.model_policies, metrics, prefixes
        )
        self.metrics = metrics
        self._tasks: list[asyncio.Task[None]] = []

    def director(
        self, pool: UpstreamPool, outliers: OutlierDetector, attempts: int, tracing: ProxyTracing | None = None
    ) -> Director:
        """The request sequence over these parts; `pool` carries the calls it makes itself."""
        return Director(self.admission, self.router, self.responses, pool, outliers, self.metrics, attempts, tracing)

    async def start(self) -> None:
        """A first view of the replicas if Redis is up (else the registry keeps trying), then
        refreshes in the background."""
        try:
            await self.registry.refresh()
        except (RedisError, OSError) as error:
            logger.warning("no view of the replicas yet (%s); the registry retries in the background", error)
        self._tasks = [asyncio.create_task(self.registry.run())]
        if self.router.uses_prefixes:
            self._tasks.append(asyncio.create_task(self.prefix_index.run()))
            self._tasks.append(
                asyncio.create_task(self.hashers.prefetch(self.registry, self.registry.refresh_interval))
            )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.hashers.close()
        await self.client.aclose()
