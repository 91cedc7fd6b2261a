"""Routing policies: which replica of a model serves a request.

A policy is anything with `async choose(candidates, request) -> Route | None` (route.py).
The default, `affinity` (affinity.py), sends a request where its prompt's prefix is cached
until that replica is saturated, else where there is the most KV room. The others stay
selectable: `kv` takes the replica with the most free KV blocks after subtracting the
blocks this gateway and its peers have already promised to requests sent there since the
replica last reported (ties: fewer waiting requests; promises live in Redis, taken by one
Lua script, so several gateways never stampede one replica), `round_robin`,
`least_requests`, and `prefix` (rendezvous hashing on the prompt's first characters).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass

import redis.asyncio as redis
from redis.exceptions import RedisError

from pagefleet.gateway.affinity import AffinityPolicy
from pagefleet.gateway.decision import Candidate
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.prefix_index import PrefixIndex
from pagefleet.gateway.prompt_hashes import PromptHashers
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.reservations import Promise, Reservations
from pagefleet.gateway.route import Route, RoutedRequest, RoutingPolicy
from pagefleet.gateway.shape import RequestShape
from pagefleet.protocol.replica import ReplicaRecord

logger = logging.getLogger(__name__)


class KVPolicy:
    """The most free KV blocks, net of the promises every router has made (reservations.py).

    With a single candidate there is nothing to choose: its promise is recorded while the
    request already goes out (pipelined), instead of waiting a Redis round trip for it."""

    name = "kv"

    def __init__(self, client: redis.Redis) -> None:
        self.reservations = Reservations(client)
        self._in_flight: set[asyncio.Future[Promise | None]] = set()

    async def choose(self, candidates: list[ReplicaRecord], request: RoutedRequest) -> Route | None:
        if not candidates:
            return None
        if len(candidates) == 1:
            reserving = asyncio.ensure_future(self._reserve(candidates, request))
            self._in_flight.add(reserving)
            reserving.add_done_callback(self._in_flight.discard)
            return Route(candidates[0], functools.partial(self._release_once_made, reserving), request.estimated_blocks)
        promise = await self._reserve(candidates, request)
        if promise is None:  # without Redis, route on the reports alone
            return Route(by_load(candidates)[0])
        return Route(promise.replica, functools.partial(self._release, promise), request.estimated_blocks)

    async def _release_once_made(self, reserving: asyncio.Future[Promise | None]) -> None:
        promise = await reserving
        if promise is not None:
            await self._release(promise)

    async def _release(self, promise: Promise) -> None:
        try:
            await self.reservations.release(promise)
        except (RedisError, OSError):
            pass  # it goes with the replica's next report, or its TTL

    async def _reserve(self, candidates: list[ReplicaRecord], request: RoutedRequest) -> Promise | None:
        try:
            return await self.reservations.reserve(candidates, request.estimated_blocks)
        except (RedisError, OSError) as error:
            logger.debug("reservation failed (%s); routing without one", error)
            return None


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
        return Route(min(candidates, key=lambda r: (r.running + r.waiting, -r.room_blocks)))


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
            return hashlib.blake2b(f"{request.shape.prefix}\0{record.replica_id}".encode(), digest_size=8).digest()

        preferred = max(candidates, key=affinity)
        emptiest = max(candidates, key=lambda r: r.room_blocks)
        if preferred.room_blocks < self.min_free_ratio * emptiest.room_blocks:
            return Route(emptiest)
        return Route(preferred)


def by_load(records: list[ReplicaRecord]) -> list[ReplicaRecord]:
    """Replicas best first by their reports alone, in the fleet's one ranking by load
    (decision.Candidate.load_rank; `affinity` adds what it sent since)."""
    return sorted(records, key=lambda r: Candidate(r).load_rank(), reverse=True)


def fallbacks(candidates: list[ReplicaRecord], chosen: ReplicaRecord) -> list[ReplicaRecord]:
    """The other replicas best first by load, for a policy that names none itself."""
    return by_load([r for r in candidates if r.url != chosen.url])


def serves(role: str, phase: str) -> bool:
    """Whether a replica of `role` takes requests of `phase` (prefill, decode or whole)."""
    return role == "prefill" if phase == "prefill" else role != "prefill"


POLICY_NAMES = ("affinity", "kv", "round_robin", "least_requests", "prefix")


@dataclass(slots=True)
class PrefixRouting:
    """What the `affinity` policy reads: prompt hashers and the fleet's prefix index."""

    hashers: PromptHashers
    index: PrefixIndex
    saturation_s: float


def make_policy(name: str, client: redis.Redis, prefixes: PrefixRouting, metrics: GatewayMetrics) -> RoutingPolicy:
    if name == "affinity":
        return AffinityPolicy(prefixes.hashers, prefixes.index, metrics, prefixes.saturation_s)
    if name == "kv":
        return KVPolicy(client)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_requests":
        return LeastRequestsPolicy()
    if name == "prefix":
        return PrefixPolicy()
    raise ValueError(f"policy: unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


class Router:
    """The replica for a request: its model's policy over the live replicas not yet tried.
    The gateway and the picker both route through one."""

    def __init__(
        self,
        registry: ReplicaRegistry,
        default_policy: RoutingPolicy,
        model_policies: dict[str, RoutingPolicy],
        metrics: GatewayMetrics,
    ) -> None:
        self.registry, self.default_policy, self.model_policies = registry, default_policy, model_policies
        self.metrics = metrics

    @classmethod
    def from_names(
        cls,
        registry: ReplicaRegistry,
        client: redis.Redis,
        policy: str,
        model_policies: dict[str, str],
        metrics: GatewayMetrics,
        prefixes: PrefixRouting,
    ) -> Router:
        policies = {model: make_policy(name, client, prefixes, metrics) for model, name in model_policies.items()}
        return cls(registry, make_policy(policy, client, prefixes, metrics), policies, metrics)

    @property
    def uses_prefixes(self) -> bool:
        """Whether any model is routed by `affinity` (which needs the prefix index)."""
        return any(p.name == "affinity" for p in [self.default_policy, *self.model_policies.values()])

    def is_disaggregated(self, model: str) -> bool:
        """Whether the model's live replicas include prefill and decode ones: its requests
        then prefill on one and decode on the other."""
        roles = {record.role for record in self.registry.candidates(model)}
        return "prefill" in roles and bool(roles & {"decode", "both"})

    async def pick(self, shape: RequestShape, tried: set[str], phase: str = "whole") -> Route | None:
        """A route to a replica of the request's model whose URL is not in `tried`, or None
        if there is none left. `phase`: "prefill" (prefill replicas only, for the prompt),
        "decode" (decode replicas) or "whole" (the whole request: any replica but a prefill
        one, unless prefill replicas are all there is)."""
        started = time.perf_counter()
        candidates = [r for r in self.registry.candidates(shape.model, skip=tried) if serves(r.role, phase)]
        if not candidates and phase == "whole":
            candidates = self.registry.candidates(shape.model, skip=tried)
        if not candidates:
            return None
        policy = self.model_policies.get(shape.model, self.default_policy)
        block_size = candidates[0].block_size
        blocks = shape.prompt_blocks(block_size) if phase == "prefill" else shape.blocks(block_size)
        routed = RoutedRequest(shape, blocks)
        route = await policy.choose(candidates, routed)
        if route is not None:
            route.policy, route.num_candidates = policy.name, len(candidates)
            if not route.fallbacks:
                route.fallbacks = fallbacks(candidates, route.replica)
            self.metrics.routing_decisions.labels(shape.model, route.replica.replica_id, policy.name).inc()
            decided = time.perf_counter() - started
            self.metrics.routing_decision_seconds.labels(shape.model, policy.name).observe(decided)
        return route
