"""`pagefleet picker` behind a real Envoy (examples/envoy/): requests go where the picker
says, by free KV blocks and the shared reservations, through Envoy's own data plane."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis as redis_sync
from grpc_health.v1 import health_pb2

from pagefleet.gateway.reservations import promise_keys
from pagefleet.protocol.replica import ReplicaRecord, model_pattern, record_key
from tests.envoy import EnvoyProcess, PickerProcess, render_config, start_envoy, start_picker
from tests.gateway.conftest import start_replica, two_turns
from tests.processes import (
    EngineServer,
    RedisProcess,
    free_port,
    running_redis,
    stop_process,
    stop_server,
    wait_for,
)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class EnvoyFleet:
    redis: RedisProcess
    small: EngineServer  # 200 KV blocks
    large: EngineServer  # 600 KV blocks
    picker: PickerProcess
    envoy: EnvoyProcess
    logs: Path

    def envoy_with(self, directory: Path, picker_port: int, **options: object) -> EnvoyProcess:
        """Another Envoy of the example configuration; its fallback route goes to `small`."""
        fallback = int(self.small.url.rsplit(":", 1)[1])
        config = render_config(picker_port, fallback, free_port(), free_port(), **options)  # type: ignore[arg-type]
        return start_envoy(config, directory)


@pytest.fixture(scope="module")
def envoy_fleet(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnvoyFleet]:
    logs = tmp_path_factory.mktemp("envoy-fleet")
    with running_redis() as redis:
        small = start_replica(tiny_llama, logs, redis, "tiny-small")
        large = start_replica(tiny_llama, logs, redis, "tiny-large", "--num-kv-blocks", "600")
        picker = start_picker(redis.url, logs / "picker.log")
        fleet = EnvoyFleet(redis, small, large, picker, None, logs)  # type: ignore[arg-type]
        wait_for(lambda: _live_replicas(redis.url) == 2)
        fleet.envoy = fleet.envoy_with(logs, int(picker.address.split(":")[1]))
        yield fleet
        stop_process(fleet.envoy.process)
        stop_process(picker.process)
        for server in (small, large):
            stop_server(server)


def _live_replicas(redis_url: str) -> int:
    store = redis_sync.Redis.from_url(redis_url)
    try:
        return sum(1 for _ in store.scan_iter(match=model_pattern()))
    finally:
        store.close()


def _complete(url: str, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 4, "temperature": 0.0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_requests_through_envoy_land_on_the_replica_with_more_free_blocks(envoy_fleet: EnvoyFleet) -> None:
    answers = [_complete(envoy_fleet.envoy.url) for _ in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert [a.headers["x-pagefleet-replica"] for a in answers] == ["tiny-large"] * 4
    direct = _complete(envoy_fleet.large.url)
    assert answers[0].json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    metrics = httpx.get(envoy_fleet.picker.metrics_url).text
    assert 'pagefleet_picker:routing_decisions_total{model="tiny",policy="affinity",replica="tiny-large"}' in metrics
    assert 'pagefleet_picker:routing_reasons_total{model="tiny",reason="load"} 4.0' in metrics, "no prefix to follow"
    assert 'pagefleet_picker:requests_total{model="tiny",replica="tiny-large",status="200"}' in metrics


def test_the_kv_policy_releases_its_reservation_when_the_response_ends(envoy_fleet: EnvoyFleet, tmp_path: Path) -> None:
    picker = start_picker(envoy_fleet.redis.url, tmp_path / "picker.log", "--policy", "kv")
    envoy = envoy_fleet.envoy_with(tmp_path, int(picker.address.split(":")[1]))
    store = redis_sync.Redis.from_url(envoy_fleet.redis.url)
    try:
        assert _complete(envoy.url, max_tokens=8).status_code == 200
        record = ReplicaRecord.model_validate_json(store.get(record_key("tiny", "tiny-large")))  # type: ignore[arg-type]
        promises, total = promise_keys(record)
        # Released by the picker at the end of the exchange, before any report would drop it.
        wait_for(lambda: store.zcard(promises) == 0 and int(store.get(total) or 0) == 0, timeout=5)
    finally:
        store.close()
        stop_process(envoy.process)
        stop_process(picker.process)


def test_streaming_passes_through_envoy_unchanged(envoy_fleet: EnvoyFleet) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}

    def events(url: str) -> list[dict[str, object]]:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]]

    def text(chunks: list[dict[str, object]]) -> str:
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])  # type: ignore[index]

    through_envoy, direct = events(envoy_fleet.envoy.url), events(envoy_fleet.large.url)
    assert len(through_envoy) > 2, "relayed as a stream of events, not one body"
    assert through_envoy[-1]["usage"]["completion_tokens"] == 12  # type: ignore[index]
    assert text(through_envoy) == text(direct)


def test_refusals_are_openai_errors_from_the_picker(envoy_fleet: EnvoyFleet) -> None:
    unknown = _complete(envoy_fleet.envoy.url, model="no-such-model")
    assert unknown.status_code == 404
    assert unknown.headers["content-type"] == "application/json"
    assert unknown.json()["error"]["param"] == "model" and "tiny" in unknown.json()["error"]["message"]
    bad = httpx.post(f"{envoy_fleet.envoy.url}/v1/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == 400
    # A request without a body (no model named) goes to a live replica.
    models = httpx.get(f"{envoy_fleet.envoy.url}/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


def test_the_request_body_in_envoys_streaming_mode(envoy_fleet: EnvoyFleet, tmp_path: Path) -> None:
    """FULL_DUPLEX_STREAMED, the protocol's streaming mode: the picker reads the body as it
    streams, answers the headers, then hands the body back unchanged."""
    picker_port = int(envoy_fleet.picker.address.split(":")[1])
    duplex = envoy_fleet.envoy_with(tmp_path, picker_port, body_mode="FULL_DUPLEX_STREAMED")
    try:
        answer = _complete(duplex.url, prompt=[9] * 300)  # a body in more than one piece is fine too
        assert answer.status_code == 200 and answer.headers["x-pagefleet-replica"] == "tiny-large"
        assert answer.json()["usage"]["prompt_tokens"] == 300
    finally:
        stop_process(duplex.process)


def test_a_dead_replica_is_not_picked_once_its_record_expires(envoy_fleet: EnvoyFleet, tiny_llama: Path) -> None:
    doomed = start_replica(tiny_llama, envoy_fleet.logs, envoy_fleet.redis, "tiny-doomed", "--num-kv-blocks", "900")
    try:
        wait_for(lambda: _live_replicas(envoy_fleet.redis.url) == 3)
        wait_for(lambda: _complete(envoy_fleet.envoy.url).headers.get("x-pagefleet-replica") == "tiny-doomed")
        doomed.kill()
        wait_for(lambda: _live_replicas(envoy_fleet.redis.url) == 2, timeout=10)  # its record's TTL: 1.5 s
        wait_for(lambda: _complete(envoy_fleet.envoy.url).status_code == 200, timeout=5)
        answers = [_complete(envoy_fleet.envoy.url) for _ in range(3)]
        assert [a.headers["x-pagefleet-replica"] for a in answers] == ["tiny-large"] * 3
    finally:
        stop_server(doomed)


@pytest.mark.parametrize("fail_open", [False, True])
def test_with_the_picker_down_envoys_failure_mode_decides(
    envoy_fleet: EnvoyFleet, tmp_path: Path, fail_open: bool
) -> None:
    nobody = free_port()  # no picker listens here
    envoy = envoy_fleet.envoy_with(tmp_path, nobody, fail_open=fail_open)
    try:
        answer = _complete(envoy.url)
        if fail_open:  # through without the header: the fallback route (here, the small replica)
            assert answer.status_code == 200
            assert answer.json()["model"] == "tiny"
        else:
            assert answer.status_code == 500
    finally:
        stop_process(envoy.process)


def test_keys_and_rate_limits_are_enforced_by_the_picker(envoy_fleet: EnvoyFleet, tmp_path: Path) -> None:
    flags = ("--api-keys", '["key-one"]', "--requests-per-minute", "2")
    picker = start_picker(envoy_fleet.redis.url, tmp_path / "picker.log", *flags)
    envoy = envoy_fleet.envoy_with(tmp_path, int(picker.address.split(":")[1]))
    try:
        url = f"{envoy.url}/v1/completions"
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(url, json=body, timeout=30).status_code == 401
        keyed = {"Authorization": "Bearer key-one"}
        statuses = [httpx.post(url, json=body, headers=keyed, timeout=30).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        refused = httpx.post(url, json=body, headers=keyed, timeout=30)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == 429
    finally:
        stop_process(envoy.process)
        stop_process(picker.process)


def test_a_responses_conversation_through_envoy(envoy_fleet: EnvoyFleet) -> None:
    """The Responses API behind Envoy: a follow-up (its conversation read from Redis by the
    picker, to hash its prompt) lands where the first turn ran and reads its prompt's start
    from that cache; a stored response is retrieved through Envoy from any replica."""
    client = openai.OpenAI(base_url=f"{envoy_fleet.envoy.url}/v1", api_key="unused", max_retries=0)
    first, second = two_turns(envoy_fleet.envoy.url)
    assert second.headers["x-pagefleet-replica"] == first.headers["x-pagefleet-replica"]
    assert second.parse().usage.input_tokens_details.cached_tokens >= 16
    assert client.responses.retrieve(second.parse().id).output_text == second.parse().output_text


def test_health_checks_follow_redis(tmp_path: Path) -> None:
    """Liveness while the process runs; readiness while it has a view of the replicas."""
    with running_redis() as redis:
        picker = start_picker(redis.url, tmp_path / "picker.log", "--redis-grace-s", "1")
        try:
            assert picker.health("liveness") == SERVING
            assert picker.health("envoy.service.ext_proc.v3.ExternalProcessor") == SERVING
            redis.stop()
            wait_for(lambda: picker.health("readiness") == NOT_SERVING, timeout=10)
            assert picker.health("liveness") == SERVING
        finally:
            stop_process(picker.process)
    log = picker.log.read_text()
    assert "Traceback" not in log, log
