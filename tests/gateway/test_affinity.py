"""Prefix-aware routing with real parts: tiny engine replicas publishing their prefix caches
to a real Redis, the gateway's own index following them, and the gateway routing on it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from pagefleet.gateway.prefix_index import PrefixIndex
from pagefleet.gateway.prompt_hashes import PromptHasher
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.protocol.tokenizer_info import TokenizerInfo
from tests.envoy import FrontDoor, front_door
from tests.gateway.conftest import prefix_routing_ready, start_replica
from tests.processes import (
    EngineServer,
    GatewayProcess,
    RedisProcess,
    metrics,
    running_redis,
    start_gateway,
    stop_process,
    stop_server,
    wait_for,
)

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n{% endfor %}<|assistant|>"
SYSTEM = "You answer questions about the solar system in one short sentence, and never more. " * 3
SMALL_CACHE = ("--num-kv-blocks", "48")  # 384 token slots: a few prompts evict the first
QUESTIONS = ("What is a comet made of?", "Where do comets come from?")  # one system prompt, two questions


@dataclass
class AffinityFleet:
    redis: RedisProcess
    replicas: dict[str, EngineServer]
    gateway: GatewayProcess
    hasher: PromptHasher
    logs: Path


@pytest.fixture(scope="module")
def chat_model(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a chat template."""
    directory = tmp_path_factory.mktemp("tiny-chat") / "model"
    shutil.copytree(tiny_llama, directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory


@pytest.fixture(scope="module")
def affinity_fleet(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AffinityFleet]:
    logs = tmp_path_factory.mktemp("affinity")
    with running_redis() as redis:
        replicas = {name: start_replica(chat_model, logs, redis, name, *SMALL_CACHE) for name in ("tiny-a", "tiny-b")}
        gateway = start_gateway(redis.url, logs / "gateway.log")
        wait_for(lambda: prefix_routing_ready(gateway.url))
        info = httpx.get(f"{replicas['tiny-a'].url}/tokenizer_info", timeout=10).json()
        yield AffinityFleet(redis, replicas, gateway, PromptHasher(TokenizerInfo.model_validate(info)), logs)
        stop_process(gateway.process)
        for replica in replicas.values():
            stop_server(replica)


@contextlib.contextmanager
def door_to(kind: str, fleet: AffinityFleet, *flags: str) -> Iterator[FrontDoor]:
    """A front door of `kind` over the fleet, once its prefix routing is ready."""
    with front_door(kind, fleet.redis.url, fleet.logs, fleet.replicas["tiny-a"].url, *flags) as door:
        wait_for(lambda: 'prefix_routing_ready{model="tiny"} 1.0' in httpx.get(door.metrics_url).text)
        yield door


def _follow_index(redis_url: str, until: Callable[[PrefixIndex], bool], timeout: float = 1.0) -> float:
    """Follow the fleet's index as a gateway does (its snapshot, then its stream) until
    `until(index)` holds; the seconds that took. Fails after `timeout`."""

    async def follow() -> float:
        client = aioredis.from_url(redis_url)
        registry = ReplicaRegistry(client, refresh_interval=0.1, ttl=1.5, grace=5.0)
        index = PrefixIndex(client, registry)
        started = time.monotonic()
        try:
            while time.monotonic() - started < timeout:
                await registry.refresh()
                await index.refresh()
                if until(index):
                    return time.monotonic() - started
            raise AssertionError(f"the index did not get there within {timeout} s")
        finally:
            await client.aclose()

    return asyncio.run(follow())


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _chat(url: str, question: str, system: str = SYSTEM, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "messages": _messages(system, question), "max_tokens": 2, "temperature": 0.0, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def _matched(index: PrefixIndex, hashes: list[int], replica: str) -> int:
    return index.matched_blocks("tiny", hashes, [replica])[replica]


@pytest.mark.parametrize("door_kind", ["gateway", "envoy"])
def test_a_burst_beyond_the_holders_threshold_spills_through_either_door(
    affinity_fleet: AffinityFleet, door_kind: str
) -> None:
    """First in this module: a replica's cost is judged at the prefill rate it measured,
    which the tiny model's earlier requests would make differ between the two replicas.

    A threshold every queue exceeds: the prefix's holder is saturated as soon as requests
    are in flight to it, and a burst moves on once its queue outweighs what the whole
    prompt costs elsewhere (decision.COLD_PREFILL_WEIGHT times its prefill). The same
    through both front doors: the spilled requests name the holder for their replica to
    pull the prefix from."""
    with door_to(door_kind, affinity_fleet, "--saturation-s", "0.000001") as door:
        system = f"A new system prompt about asteroids ({door_kind}), long enough to fill blocks. " * 2
        body = {"model": "tiny", "max_tokens": 2}

        def ask(n: int) -> str:
            # A long question of its own: each request adds a lot to the holder's queue.
            question = f"Asteroid {n}: " + "what is its orbit, its size and its composition? " * 4
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            answer = httpx.post(f"{door.url}/v1/chat/completions", json={**body, "messages": messages}, timeout=60)
            assert answer.status_code == 200
            return answer.headers["x-pagefleet-replica"]

        hinted_before = _peer_pulls(affinity_fleet)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            served = list(pool.map(ask, range(16)))
        assert sorted(set(served)) == ["tiny-a", "tiny-b"], served
        assert 'reason="saturated"' in httpx.get(door.metrics_url).text
        # Each spilled request named the holder for its replica to pull the prefix from (the
        # tiny model computes faster than a pull: the replicas' cost model turns them down).
        assert _peer_pulls(affinity_fleet) > hinted_before


def _peer_pulls(fleet: AffinityFleet) -> float:
    """The peer pulls the replicas were asked for, whatever came of them."""
    return sum(
        value
        for replica in fleet.replicas.values()
        for name, value in metrics(replica).items()
        if name.startswith("pagefleet:kv_peer_pulls_total")
    )


def test_both_front_doors_send_a_prefix_where_the_other_sent_it(affinity_fleet: AffinityFleet) -> None:
    """One director, two doors: a prompt the gateway placed is followed there by the picker,
    and the other way round."""
    with door_to("envoy", affinity_fleet) as envoy:
        gateway = affinity_fleet.gateway.url
        for first, then in ((gateway, envoy.url), (envoy.url, gateway)):
            system = f"Comets only, first asked at {first}: answer in a few words. " * 3
            asked = _chat(first, QUESTIONS[0], system=system)
            assert asked.status_code == 200
            holder = asked.headers["x-pagefleet-replica"]
            _wait_until_indexed(affinity_fleet, holder, system)
            followed = _chat(then, QUESTIONS[1], system=system)
            assert followed.headers["x-pagefleet-replica"] == holder
            assert followed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(system) // 8


def _wait_until_indexed(fleet: AffinityFleet, holder: str, system: str) -> None:
    """Wait until the fleet's index has `holder` caching the chat prefix `system` makes: the
    other door learns it from the replica's KV events, which may leave after the answer."""
    chains = []
    for question in QUESTIONS:
        hashed = fleet.hasher.hashes({"messages": _messages(system, question)}, True, None)
        assert hashed is not None
        chains.append(hashed[1])
    prefix = [a for a, _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(*chains, strict=False))]
    assert len(prefix) >= 3
    _follow_index(fleet.redis.url, lambda index: _matched(index, prefix, holder) == len(prefix), timeout=5)


def test_stored_blocks_appear_and_evicted_ones_disappear_within_a_second(affinity_fleet: AffinityFleet) -> None:
    replica = affinity_fleet.replicas["tiny-a"]
    prompt = "The planets of the solar system, in order: Mercury, Venus, Earth, Mars. " * 3
    hashed = affinity_fleet.hasher.hashes({"prompt": prompt}, False, None)
    assert hashed is not None and len(hashed[1]) >= 6
    hashes = hashed[1]
    assert _complete(replica.url, prompt).status_code == 200
    _follow_index(affinity_fleet.redis.url, lambda index: _matched(index, hashes, "tiny-a") == len(hashes))
    # Other prompts fill the small cache: the first prompt's blocks are evicted.
    for n in range(6):
        assert (
            _complete(replica.url, f"Fact {n}: " + f"moon number {n} orbits a planet quietly. " * 8).status_code == 200
        )
    _follow_index(affinity_fleet.redis.url, lambda index: _matched(index, hashes, "tiny-a") < len(hashes))
    # vLLM's reset empties the cache, and so the replica's part of the index.
    assert httpx.post(f"{replica.url}/reset_prefix_cache", timeout=10).status_code == 200
    _follow_index(affinity_fleet.redis.url, lambda index: not index.models["tiny"].held.get("tiny-a"))


def test_a_killed_replicas_entries_stop_counting_when_its_record_expires(
    affinity_fleet: AffinityFleet, chat_model: Path
) -> None:
    doomed = start_replica(chat_model, affinity_fleet.logs, affinity_fleet.redis, "tiny-doomed", *SMALL_CACHE)
    try:
        prompt = "Comets come from the Oort cloud and the Kuiper belt, far beyond Neptune. " * 3
        hashes = affinity_fleet.hasher.hashes({"prompt": prompt}, False, None)[1]  # type: ignore[index]
        assert _complete(doomed.url, prompt).status_code == 200
        _follow_index(affinity_fleet.redis.url, lambda index: _matched(index, hashes, "tiny-doomed") == len(hashes))
        doomed.kill()
        # Its record lives 1.5 s (--record-ttl); then no router counts its blocks.
        _follow_index(affinity_fleet.redis.url, lambda i: "tiny-doomed" not in i.models["tiny"].held, timeout=5)
    finally:
        stop_server(doomed)


def test_the_same_system_prompt_lands_where_it_is_cached(affinity_fleet: AffinityFleet) -> None:
    gateway = affinity_fleet.gateway.url
    first = _chat(gateway, "Which planet is largest?")
    assert first.status_code == 200
    cold = (first.json()["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0)
    assert cold <= 8, "at most the template's first block was cached before"
    holder = first.headers["x-pagefleet-replica"]
    for question in ("Which planet is smallest?", "How many moons has Mars?", "Is Pluto a planet?"):
        answer = _chat(gateway, question)
        assert answer.headers["x-pagefleet-replica"] == holder
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(SYSTEM) // 8
    metrics = httpx.get(f"{gateway}/metrics").text
    followed = re.search(r'pagefleet_gateway:routing_reasons_total\{model="tiny",reason="affinity"\} (\S+)', metrics)
    assert followed is not None and float(followed.group(1)) >= 3, "each later question followed its prefix"
    assert 'pagefleet_gateway:cached_prompt_tokens_total{model="tiny",replica="' + holder in metrics


def test_without_redis_requests_are_routed_by_load_and_none_fails(affinity_fleet: AffinityFleet) -> None:
    """Last in this module: it stops the fleet's Redis."""
    affinity_fleet.redis.process.kill()
    affinity_fleet.redis.process.wait()
    statuses = [_chat(affinity_fleet.gateway.url, f"Question {n} without Redis?").status_code for n in range(6)]
    assert statuses == [200] * 6
