"""Whether a request may be routed at all, decided before any replica is chosen: the API
key, the body's shape, a view of the replicas, a model that exists, the key's rate limits.
The gateway and the picker both ask it; each refusal is counted and carries its answer."""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from pagefleet.gateway import errors
from pagefleet.gateway.errors import Refusal
from pagefleet.gateway.limits import RateLimiter
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.shape import RequestShape, describe
from pagefleet.protocol.demand import DemandSignal
from pagefleet.runtime.http import is_api_path

logger = logging.getLogger(__name__)


class APIKeyGuard:
    """Every /v1 route needs a key when keys are set (as vLLM's --api-key), the gateway's own
    (`GET /v1/models`, stored responses) as well as the proxied ones; probes, metrics and
    the dashboard stay open. Anthropic's clients send theirs as `x-api-key`."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app, self.admission = app, admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.admission.api_keys and is_api_path(scope):
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not authorization and b"x-api-key" in headers:
                authorization = "Bearer " + headers[b"x-api-key"].decode("latin-1")
            try:
                self.admission.authorize(authorization)
            except Refusal as refusal:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def bearer_key(authorization: str) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, else None."""
    return authorization[7:].strip() if authorization[:7].lower() == "bearer " else None


class Admission:
    """Args:
    demand: says in Redis that a model scaled to zero is asked for (protocol/demand.py).
    hold_timeout, hold_max_requests: how long, and how many requests, a model scaled to
        zero holds while a replica starts.
    """

    def __init__(
        self,
        api_keys: set[str],
        registry: ReplicaRegistry,
        limiter: RateLimiter,
        metrics: GatewayMetrics,
        demand: DemandSignal,
        hold_timeout: float,
        hold_max_requests: int,
    ) -> None:
        self.api_keys, self.registry, self.limiter, self.metrics = api_keys, registry, limiter, metrics
        self.demand, self.hold_timeout, self.hold_max_requests = demand, hold_timeout, hold_max_requests
        self._held: dict[str, int] = {}  # model -> requests held for it now
        self._askers: dict[str, asyncio.Task[None]] = {}  # model -> its demand signal while any is held

    def authorize(self, authorization: str) -> str | None:
        """The caller's API key; raises a Refusal (401) when keys are required and this is
        not one of them."""
        key = bearer_key(authorization)
        if self.api_keys and key not in self.api_keys:
            raise self.metrics.refused(errors.unauthorized())
        return key

    async def admit(self, authorization: str, body: bytes, chat: bool) -> RequestShape:
        """The request's shape if it may be routed; raises the Refusal to answer otherwise."""
        key = self.authorize(authorization)
        try:
            return await self._admit(key, body, chat)
        except Refusal as refusal:
            self.metrics.refused(refusal)
            raise

    async def _admit(self, key: str | None, body: bytes, chat: bool) -> RequestShape:
        shape = describe(body, chat)
        if not self.registry.is_available:
            raise errors.registry_unavailable()
        if not shape.model:
            shape.model = self._only_model()
        if not self.registry.is_known(shape.model):
            raise errors.unknown_model(shape.model, self.registry.models())
        if key is not None and self.limiter.enabled:
            verdict = await self.limiter.check(key, shape.tokens)
            if not verdict.allowed:
                self.metrics.rate_limited.labels(shape.model).inc()
                raise errors.rate_limited(shape.model, verdict.reason, verdict.retry_after)
        if shape.model in self.registry.scalable:
            await self.demand.note(shape.model)  # keeps it from being stopped as idle
            if self.registry.is_scaled_to_zero(shape.model):
                await self._hold(shape.model)
        return shape

    def _only_model(self) -> str:
        """The model a request without `model` means: the fleet's one base model (vLLM's
        server means its own); with several there is no such thing, a 400."""
        bases = sorted({name for name, records in self.registry.by_model.items() if records} | self.registry.scalable)
        if len(bases) != 1:
            raise errors.bad_request(f"model: required, since this gateway serves {len(bases)} models", "model")
        return bases[0]

    async def _hold(self, model: str) -> None:
        """Wait while a replica of `model` starts (the demand signal asks for one). Every
        held request waits on the registry at once, so they resume in the order they came;
        one task per model keeps asking while any is held."""
        held = self._held.get(model, 0)
        if held >= self.hold_max_requests:
            raise errors.hold_full(model, self.hold_max_requests)
        self._held[model] = held + 1
        self.metrics.held_requests.labels(model).inc()
        if held == 0:
            self._askers[model] = asyncio.create_task(self._keep_asking(model))
        try:
            if not await self.registry.until_served(model, self.hold_timeout):
                raise errors.not_started(model, self.hold_timeout)
        finally:
            self._held[model] -= 1
            self.metrics.held_requests.labels(model).dec()
            if not self._held[model]:
                self._askers.pop(model).cancel()

    async def _keep_asking(self, model: str) -> None:
        """Once a second while requests of `model` are held: a replica stopped meanwhile
        (the autoscaler saw it idle) is asked for again."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.demand.note(model)
            except (RedisError, OSError) as error:  # the next second tries again
                logger.warning("could not signal demand for %s: %r", model, error)
