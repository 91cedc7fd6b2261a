"""The gateway's decisions without a gateway process: routing policies on replica records,
request shaping, and the rate limiter on a real Redis."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from pagefleet.gateway.errors import Refusal
from pagefleet.gateway.limits import RateLimiter
from pagefleet.gateway.routing import LeastRequestsPolicy, PrefixPolicy, RoundRobinPolicy, RoutedRequest
from pagefleet.gateway.shape import describe
from pagefleet.protocol.replica import ReplicaRecord
from tests.processes import RedisProcess


def _replica(name: str, free: int = 100, running: int = 0, waiting: int = 0) -> ReplicaRecord:
    return ReplicaRecord(
        replica_id=name,
        model="m",
        url=f"http://{name}:8000",
        free_blocks=free,
        total_blocks=100,
        block_size=16,
        running=running,
        waiting=waiting,
        max_model_len=2048,
    )


def _choose(policy, candidates: list[ReplicaRecord], prefix: str = "", model: str = "m") -> str | None:  # type: ignore[no-untyped-def]
    route = asyncio.run(policy.choose(candidates, RoutedRequest(model, 1, prefix)))
    return None if route is None else route.replica.replica_id


def test_round_robin_takes_turns_per_model_in_a_stable_order() -> None:
    policy = RoundRobinPolicy()
    replicas = [_replica("b"), _replica("a"), _replica("c")]
    assert [_choose(policy, replicas) for _ in range(4)] == ["a", "b", "c", "a"]
    assert _choose(policy, replicas, model="other") == "a", "each model has its own turn"
    assert _choose(policy, []) is None


def test_least_requests_counts_running_and_waiting_then_prefers_free_blocks() -> None:
    policy = LeastRequestsPolicy()
    busy, idle = _replica("busy", running=3, waiting=2), _replica("idle", running=1)
    assert _choose(policy, [busy, idle]) == "idle"
    tie_small, tie_large = _replica("small", free=10, running=1), _replica("large", free=90, running=1)
    assert _choose(policy, [tie_small, tie_large]) == "large"


def test_prefix_keeps_a_prompt_on_one_replica_unless_it_is_much_fuller() -> None:
    policy = PrefixPolicy(min_free_ratio=0.5)
    replicas = [_replica(name) for name in "abcd"]
    prompts = [f"system prompt {i}: " for i in range(20)]
    first = [_choose(policy, replicas, prefix) for prefix in prompts]
    assert [_choose(policy, list(reversed(replicas)), prefix) for prefix in prompts] == first, "order does not matter"
    assert len(set(first)) > 1, "different prompts spread over the replicas"
    chosen = first[0]
    crowded = [_replica(r.replica_id, free=10 if r.replica_id == chosen else 100) for r in replicas]
    assert _choose(policy, crowded, prompts[0]) != chosen, "below half the emptiest's free blocks: go elsewhere"


def test_request_shaping_estimates_what_routing_and_limits_need() -> None:
    shape = describe(json.dumps({"model": "m", "prompt": "x" * 400, "max_tokens": 50, "n": 2}).encode(), chat=False)
    assert (shape.model, shape.max_tokens, shape.num_sequences) == ("m", 50, 2)
    assert shape.prompt_tokens == 100 and shape.tokens == 100 + 2 * 50  # ~4 characters a token
    assert shape.blocks(16) == 7 + 2 * 4
    ids = describe(json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}).encode(), chat=False)
    assert ids.prompt_tokens == 3 and ids.prefix == "1,2,3"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_completion_tokens": 9}
    assert describe(json.dumps(chat).encode(), chat=True).max_tokens == 9
    for body, param in (
        (b"{", None),
        (b"[]", None),
        (b'{"prompt": "x"}', "model"),
        (b'{"model": "m", "n": "2"}', "max_tokens"),
    ):
        with pytest.raises(Refusal) as refused:
            describe(body, chat=False)
        assert (refused.value.status, refused.value.param) == (400, param)


def test_rate_limiter_counts_requests_and_tokens_per_key_per_minute(redis_server: RedisProcess) -> None:
    async def scenario() -> list[tuple[bool, str]]:
        client = aioredis.from_url(redis_server.url)
        limiter = RateLimiter(client, requests_per_minute=2, tokens_per_minute=100)
        verdicts = [
            await limiter.check("key-a", 10),
            await limiter.check("key-a", 10),
            await limiter.check("key-a", 10),  # a third request in the minute
            await limiter.check("key-b", 150),  # another key, too many tokens at once
            await limiter.check("key-c", 10),  # its own budget
        ]
        await client.aclose()
        return [(v.allowed, v.reason) for v in verdicts]

    verdicts = asyncio.run(scenario())
    assert [allowed for allowed, _ in verdicts] == [True, True, False, False, True]
    assert "2 requests per minute" in verdicts[2][1] and "100 tokens per minute" in verdicts[3][1]


def test_rate_limiter_fails_open_when_redis_is_gone() -> None:
    async def scenario() -> bool:
        client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        verdict = await RateLimiter(client, 1, 0).check("key", 1)
        await client.aclose()
        return verdict.allowed

    assert asyncio.run(scenario()), "Redis trouble must not stop traffic"
