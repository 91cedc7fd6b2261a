"""Whether a request may be routed at all, decided before any replica is chosen: the API
key, the body's shape, a view of the replicas, a model that exists, the key's rate limits.
The gateway and the picker both ask it; each refusal is counted and carries its answer."""

from __future__ import annotations

from pagefleet.gateway import errors
from pagefleet.gateway.errors import Refusal
from pagefleet.gateway.limits import RateLimiter
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.shape import RequestShape, describe


def bearer_key(authorization: str) -> str | None:
    """The key of an `Authorization: Bearer <key>` header, else None."""
    return authorization[7:].strip() if authorization[:7].lower() == "bearer " else None


class Admission:
    def __init__(
        self, api_keys: set[str], registry: ReplicaRegistry, limiter: RateLimiter, metrics: GatewayMetrics
    ) -> None:
        self.api_keys, self.registry, self.limiter, self.metrics = api_keys, registry, limiter, metrics

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
        if not self.registry.is_known(shape.model):
            raise errors.unknown_model(shape.model, self.registry.models())
        if key is not None and self.limiter.enabled:
            verdict = await self.limiter.check(key, shape.tokens)
            if not verdict.allowed:
                self.metrics.rate_limited.labels(shape.model).inc()
                raise errors.rate_limited(shape.model, verdict.reason, verdict.retry_after)
        return shape
