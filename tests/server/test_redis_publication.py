"""The replica record in a real Redis: appears, follows load, survives Redis restarts,
expires when the replica is killed, and is removed on a clean stop."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import redis

from pagefleet.protocol.replica import ReplicaRecord, model_pattern, record_key
from tests.processes import RedisProcess, start_server, stop_server, wait_for

TTL = "1.5"


def _record(client: redis.Redis, model: str, replica: str) -> ReplicaRecord | None:
    raw = client.get(record_key(model, replica))
    return ReplicaRecord.model_validate_json(raw) if raw else None


def _serve(tiny_llama: Path, log: Path, redis_server: RedisProcess, replica: str):  # type: ignore[no-untyped-def]
    return start_server(
        str(tiny_llama),
        log,
        "--served-model-name", "tiny",
        "--replica-id", replica,
        "--redis-url", redis_server.url,
        "--record-ttl", TTL,
        "--num-kv-blocks", "300",
        "--block-size", "8",
    )  # fmt: skip


def test_record_follows_the_replica(tiny_llama: Path, tmp_path: Path, redis_server: RedisProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    server = _serve(tiny_llama, tmp_path / "serve.log", redis_server, "replica-a")
    try:
        record = wait_for(lambda: _record(client, "tiny", "replica-a"))
        assert record.url == server.url and record.model == "tiny"
        assert record.total_blocks == 300 and record.block_size == 8 and record.max_model_len == 512
        assert record.free_blocks == 300 and record.running == 0 and record.waiting == 0
        assert 0 < client.pttl(record_key("tiny", "replica-a")) <= 1500
        assert [key.decode() for key in client.scan_iter(model_pattern("tiny"))] == [record_key("tiny", "replica-a")]

        # Under load the record shows blocks taken and requests running.
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
        load = [
            threading.Thread(
                target=httpx.post, args=(f"{server.url}/v1/completions",), kwargs={"json": body, "timeout": 120}
            )
            for _ in range(6)
        ]
        for thread in load:
            thread.start()
        busy = wait_for(
            lambda: (r := _record(client, "tiny", "replica-a")) and r.running > 0 and r.free_blocks < 300 and r
        )
        assert busy.timestamp > record.timestamp
        for thread in load:
            thread.join()
        wait_for(lambda: (r := _record(client, "tiny", "replica-a")) and r.free_blocks == 300 and r.running == 0)

        # Redis goes away: serving goes on; Redis comes back: the record comes back.
        redis_server.stop()
        answer = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert answer.status_code == 200
        redis_server.start()
        client = redis.Redis.from_url(redis_server.url)
        assert wait_for(lambda: _record(client, "tiny", "replica-a"))
    finally:
        stop_server(server)
    assert _record(client, "tiny", "replica-a") is None, "a clean stop removes the record"


def test_killed_replica_expires(tiny_llama: Path, tmp_path: Path, redis_server: RedisProcess) -> None:
    client = redis.Redis.from_url(redis_server.url)
    server = _serve(tiny_llama, tmp_path / "serve.log", redis_server, "replica-b")
    wait_for(lambda: _record(client, "tiny", "replica-b"))
    server.kill()  # SIGKILL: no chance to clean up
    killed_at = time.monotonic()
    wait_for(lambda: _record(client, "tiny", "replica-b") is None, timeout=10)
    assert time.monotonic() - killed_at <= float(TTL) + 1.0
