"""The seam between the Router and its policies: what a policy is asked (`RoutedRequest`),
what it answers (`Route`), and the `RoutingPolicy` protocol itself."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from pagefleet.gateway.shape import RequestShape
from pagefleet.protocol.replica import ReplicaRecord


@dataclass(slots=True)
class RoutedRequest:
    shape: RequestShape
    estimated_blocks: int  # what the request may take on the replica it goes to

    @property
    def model(self) -> str:
        return self.shape.model


Release = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


@dataclass(slots=True)
class Route:
    replica: ReplicaRecord
    release: Release = field(default=_nothing)  # drop the promise (the replica failed)
    reserved_blocks: int = 0  # the KV blocks promised on the replica for this request
    policy: str = ""  # the policy that chose it (set by the Router)
    num_candidates: int = 0  # how many replicas it was chosen from (set by the Router)
    fallbacks: list[ReplicaRecord] = field(default_factory=list)  # the next best, for a proxy that retries
    reason: str = ""  # why this replica (the affinity policy: decision.REASONS)
    kv_peer: str | None = None  # the URL of a replica caching the prompt's prefix, for the chosen one to pull from


def kv_peer_of(route: Route) -> str | None:
    """The replica the chosen one should pull the prompt's prefix from (the gateway's
    `x-pagefleet-kv-peer` header, whichever front door sends the request), or None: the
    route names none, or names the chosen replica itself."""
    if route.kv_peer is None or route.kv_peer == route.replica.url:
        return None
    return route.kv_peer


class RoutingPolicy(Protocol):
    name: str

    async def choose(self, candidates: list[ReplicaRecord], request: RoutedRequest) -> Route | None: ...
