"""Scale to zero and back: the Redis keys between the routers and what runs the replicas.

- `pagefleet:scalable:<model>`: a model that may run with no replica, written by what runs
  its replicas (the operator, for `autoscaling.minReplicas: 0`; `pagefleet up`, for
  `min_replicas: 0`). Routers know such a model even with no replica: they hold its
  requests instead of answering 404.
- `pagefleet:demand:<model>`: the Unix time of the latest request for the model, written by
  the routers (at most once a second a model while it is served; every second while they
  hold requests for it). What runs the replicas starts one when this is newer than the
  moment it stopped the last, and stops them all once it is older than the idle period.
"""

from __future__ import annotations

import time

import redis.asyncio as redis

SCALABLE_PREFIX = "pagefleet:scalable:"
DEMAND_PREFIX = "pagefleet:demand:"


def scalable_key(model: str) -> str:
    return f"{SCALABLE_PREFIX}{model}"


def demand_key(model: str) -> str:
    return f"{DEMAND_PREFIX}{model}"


class DemandSignal:
    """A router's side: says that `model` was asked for, at most once a `period` a model
    (a Redis write per request would cost more than the request's routing)."""

    def __init__(self, client: redis.Redis, period: float = 1.0) -> None:
        self.client, self.period = client, period
        self._sent: dict[str, float] = {}  # model -> monotonic time of the last write

    async def note(self, model: str) -> None:
        now = time.monotonic()
        if now - self._sent.get(model, float("-inf")) < self.period:
            return
        self._sent[model] = now
        await self.client.set(demand_key(model), repr(time.time()))


def read_demand(value: bytes | str | None) -> float | None:
    """The Unix time a demand key holds (None: never asked for, or unreadable)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
