"""The gateway does not spread a request's own failure, and a client that leaves through it
stops its request on the replica.

Retry rules as built: a connection error, a timeout or a 503 before the first byte moves a
request to another replica; any other answer (a 4xx, a 500) is the request's own and goes
to the client as it is. A replica is skipped only after several failures in a row.

The replicas that misbehave on purpose are real HTTP servers (aiohttp) registered in the
real Redis with real replica records; the others are real `pagefleet serve` processes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from aiohttp import web

from pagefleet.protocol.openai import error_response
from pagefleet.protocol.replica import ReplicaRecord, record_key
from tests.gateway.conftest import Fleet, start_replica
from tests.processes import (
    GatewayProcess,
    RedisProcess,
    free_port,
    idle_with_every_block_free,
    leave_a_stream_after_a_few_events,
    leave_before_the_answer,
    metrics,
    running_redis,
    start_gateway,
    stop_process,
    stop_server,
    wait_for,
)


def _failovers(gateway_url: str) -> float:
    text = httpx.get(f"{gateway_url}/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("pagefleet_gateway:failovers_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_a_request_every_replica_refuses_passes_through_and_the_next_one_succeeds(fleet: Fleet) -> None:
    """Too long for the model's context: only the replicas know, and they say 400."""
    before = _failovers(fleet.gateway.url)
    for _ in range(5):
        refused = httpx.post(
            f"{fleet.gateway.url}/v1/completions", json={"model": "tiny", "prompt": "hi " * 600}, timeout=30
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "prompt"
        assert refused.headers["x-pagefleet-replica"] in fleet.replicas
    assert _failovers(fleet.gateway.url) == before, "a 400 is the request's own: no failover"
    ordinary = httpx.post(
        f"{fleet.gateway.url}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3}, timeout=30
    )
    assert ordinary.status_code == 200, ordinary.text


@dataclass
class FlakyReplica:
    """A real HTTP replica that answers by prompt: "fail-500" -> 500, "fail-503" -> 503,
    "drop" -> closes the connection (if `drops`), anything else -> a completion."""

    name: str
    port: int
    drops: bool
    prompts: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def completions(self, request: web.Request) -> web.StreamResponse:
        prompt = (await request.json())["prompt"]
        self.prompts.append(prompt)
        if prompt == "fail-500":
            return web.json_response(error_response(500, f"{self.name} broke on this request"), status=500)
        if prompt == "fail-503":
            return web.json_response(error_response(503, "at capacity"), status=503, headers={"Retry-After": "1"})
        if prompt == "drop" and self.drops:
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=200)
        return web.json_response({"object": "text_completion", "choices": [{"index": 0, "text": self.name}]})


@dataclass
class FlakyFleet:
    gateway: GatewayProcess
    preferred: FlakyReplica  # reports more free blocks, so the kv policy tries it first
    other: FlakyReplica


def _serve(replicas: list[FlakyReplica], stop: threading.Event) -> None:
    async def main() -> None:
        runners = []
        for replica in replicas:
            app = web.Application()
            app.router.add_post("/v1/completions", replica.completions)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", replica.port).start()
            runners.append(runner)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for runner in runners:
            await runner.cleanup()

    asyncio.run(main())


def _publish(redis_url: str, replicas: list[tuple[FlakyReplica, int]], stop: threading.Event) -> None:
    """Keep each replica's record fresh, as a live replica does."""
    client = redis.Redis.from_url(redis_url)
    while not stop.is_set():
        for replica, free_blocks in replicas:
            record = ReplicaRecord(
                replica_id=replica.name,
                model="flaky",
                url=replica.url,
                free_blocks=free_blocks,
                total_blocks=1000,
                block_size=16,
                running=0,
                waiting=0,
                max_model_len=4096,
            )
            client.set(record_key("flaky", replica.name), record.model_dump_json(), px=3000)
        stop.wait(0.3)


@pytest.fixture(scope="module")
def flaky(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FlakyFleet]:
    logs = tmp_path_factory.mktemp("flaky")
    with running_redis() as redis_process:
        yield from _flaky_fleet(redis_process, logs)


def _flaky_fleet(redis_process: RedisProcess, logs: Path) -> Iterator[FlakyFleet]:
    preferred = FlakyReplica("flaky-a", free_port(), drops=True)
    other = FlakyReplica("flaky-b", free_port(), drops=False)
    stop = threading.Event()
    threads = [
        threading.Thread(target=_serve, args=([preferred, other], stop), daemon=True),
        threading.Thread(
            target=_publish, args=(redis_process.url, [(preferred, 900), (other, 100)], stop), daemon=True
        ),
    ]
    for thread in threads:
        thread.start()
    gateway = start_gateway(redis_process.url, logs / "gateway.log", "--eject-after-failures", "3")
    wait_for(lambda: "flaky" in httpx.get(f"{gateway.url}/v1/models").text)
    yield FlakyFleet(gateway, preferred, other)
    stop.set()
    stop_process(gateway.process)
    for thread in threads:
        thread.join(timeout=10)
    redis_process.process.kill()
    redis_process.process.wait()


def _send(fleet: FlakyFleet, prompt: str) -> httpx.Response:
    return httpx.post(f"{fleet.gateway.url}/v1/completions", json={"model": "flaky", "prompt": prompt}, timeout=30)


def _clear(fleet: FlakyFleet) -> None:
    fleet.preferred.prompts.clear()
    fleet.other.prompts.clear()


def test_a_500_is_the_requests_own_and_is_passed_through_without_a_retry(flaky: FlakyFleet) -> None:
    _clear(flaky)
    for _ in range(5):
        answer = _send(flaky, "fail-500")
        assert answer.status_code == 500
        assert answer.json()["error"]["message"] == "flaky-a broke on this request"
    assert flaky.preferred.prompts == ["fail-500"] * 5 and flaky.other.prompts == []
    # Five 500s in a row do not take the replica out.
    ordinary = _send(flaky, "hello")
    assert ordinary.status_code == 200 and ordinary.headers["x-pagefleet-replica"] == "flaky-a"


def test_a_503_before_the_first_byte_moves_the_request_to_another_replica(flaky: FlakyFleet) -> None:
    _clear(flaky)
    answer = _send(flaky, "fail-503")
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert flaky.preferred.prompts == ["fail-503"] and flaky.other.prompts == ["fail-503"]


def test_a_replica_is_skipped_only_after_several_failures_in_a_row(flaky: FlakyFleet) -> None:
    def send_and_see_who_answered(prompt: str) -> str:
        answer = _send(flaky, prompt)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-pagefleet-replica"]

    _clear(flaky)
    # The preferred replica drops the connection: the request moves on and succeeds...
    assert send_and_see_who_answered("drop") == "flaky-b"
    # ...and one failure does not take the replica out (its success resets the count).
    assert send_and_see_who_answered("hello") == "flaky-a"
    # Three failures in a row do: it is skipped for a while.
    assert [send_and_see_who_answered("drop") for _ in range(3)] == ["flaky-b"] * 3
    assert send_and_see_who_answered("hello") == "flaky-b"
    assert flaky.preferred.prompts == ["drop", "hello", "drop", "drop", "drop"]


@pytest.fixture(scope="module")
def slow_fleet(slow_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("slow-fleet")
    with running_redis() as redis_process:
        replica = start_replica(slow_llama, logs, redis_process, "slow-a", "--num-kv-blocks", "512")
        gateway = start_gateway(redis_process.url, logs / "gateway.log")
        wait_for(lambda: "tiny" in httpx.get(f"{gateway.url}/v1/models").text)
        yield Fleet(redis_process, {"slow-a": replica}, gateway, logs)
        stop_process(gateway.process)
        stop_server(replica)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_client_that_leaves_through_the_gateway_stops_its_request(slow_fleet: Fleet, stream: bool) -> None:
    replica = slow_fleet.replicas["slow-a"]
    max_tokens = 440
    wait_for(lambda: idle_with_every_block_free(replica))
    before = metrics(replica)["pagefleet:generation_tokens_total"]
    body = {"model": "tiny", "prompt": "Tell me a long story:", "max_tokens": max_tokens, "ignore_eos": True}
    url = f"{slow_fleet.gateway.url}/v1/completions"
    if stream:
        leave_a_stream_after_a_few_events(url, body | {"stream": True})
    else:
        leave_before_the_answer(url, body)
    # Idle soon, however loaded the machine: what shows the request stopped is the count below
    # (a request left running would also be idle, with all its tokens generated).
    wait_for(lambda: idle_with_every_block_free(replica), timeout=10.0)
    generated = metrics(replica)["pagefleet:generation_tokens_total"] - before
    assert generated < max_tokens / 2, f"{generated} of {max_tokens} tokens: the request ran on after the client left"
