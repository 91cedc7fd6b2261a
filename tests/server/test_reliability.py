"""No request can take down a replica, and a client that leaves frees its blocks at once.

The reproductions of issue 13, through a real `pagefleet serve` (uvicorn) process: clients
that disconnect mid-stream or mid-request, seeds wider than 64 bits, a beam search whose
length penalty overflows, and a tokenize request with no messages. Then what happens when
the engine itself dies: the replica leaves Redis, fails /health, and exits non-zero.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from pagefleet.engine import AsyncEngine
from pagefleet.engine.server.app import EXIT_ENGINE_DEAD, create_app
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.protocol.replica import record_key
from pagefleet.runtime.http import ErrorGuard
from tests.processes import (
    EngineServer,
    RedisProcess,
    ServerThread,
    free_port,
    idle_with_every_block_free,
    leave_a_stream_after_a_few_events,
    leave_before_the_answer,
    metrics,
    start_server,
    stop_server,
    wait_for,
)

MAX_TOKENS = 440  # about 3 s of tokens on the slow model: leaving after a few is unmistakable


@pytest.fixture(scope="module")
def slow_server(slow_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("serve") / "slow.log"
    server = start_server(str(slow_llama), log, "--dtype", "float32", "--num-kv-blocks", "512", "--block-size", "8")
    yield server
    stop_server(server)


def _generated(server: EngineServer) -> float:
    return metrics(server)["pagefleet:generation_tokens_total"]


def _body(server: EngineServer, path: str, stream: bool) -> dict[str, object]:
    body: dict[str, object] = {"model": server.model, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
    if path == "/v1/completions":
        return body | {"prompt": "Tell me a long story:"}
    return body | {"messages": [{"role": "user", "content": "Tell me a long story."}]}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_a_client_that_leaves_stops_its_request_and_frees_its_blocks(
    slow_server: EngineServer, path: str, stream: bool
) -> None:
    wait_for(lambda: idle_with_every_block_free(slow_server))
    before = _generated(slow_server)
    body = _body(slow_server, path, stream)
    if stream:
        leave_a_stream_after_a_few_events(slow_server.url + path, body)
    else:
        leave_before_the_answer(slow_server.url + path, body)
    wait_for(lambda: idle_with_every_block_free(slow_server), timeout=1.0)
    generated = _generated(slow_server) - before
    assert generated < MAX_TOKENS / 2, f"{generated} of {MAX_TOKENS} tokens: the request ran on after the client left"


def _complete(server: EngineServer, **fields: object) -> httpx.Response:
    """A completion; a string value in `fields` is sent as a raw JSON token (1e400, NaN)."""
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 4} | fields
    text = json.dumps(body)
    for name, value in fields.items():
        if isinstance(value, str):
            text = text.replace(json.dumps({name: value})[1:-1], f'"{name}": {value}')
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}/v1/completions", content=text, headers=headers, timeout=30)


def test_seeds_across_the_64_bit_range_work_and_wider_ones_are_a_400(slow_server: EngineServer) -> None:
    for seed in (2**62, -(2**62), 2**63 - 1):
        first, second = _complete(slow_server, seed=seed, n=2), _complete(slow_server, seed=seed, n=2)
        assert first.status_code == 200, first.text
        assert [c["text"] for c in first.json()["choices"]] == [c["text"] for c in second.json()["choices"]]
    for seed in (2**64, -(2**63) - 1, 2**70):
        refused = _complete(slow_server, seed=seed)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "seed"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True, "n": 2, "length_penalty": 1e308}, "length_penalty"),
        ({"use_beam_search": True, "n": 2, "length_penalty": -1e308}, "length_penalty"),
        ({"repetition_penalty": "1e400"}, "repetition_penalty"),  # sent as the JSON number 1e400
        ({"temperature": "NaN"}, "temperature"),  # Python's JSON reader takes NaN
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"logprobs": 2**70}, "logprobs"),
    ],
)
def test_overflowing_numbers_are_a_400_and_the_replica_serves_on(
    slow_server: EngineServer, fields: dict[str, object], param: str
) -> None:
    refused = _complete(slow_server, **fields)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert httpx.get(f"{slow_server.url}/health").status_code == 200
    assert _complete(slow_server).status_code == 200


def test_tokenize_without_messages_is_a_400_and_the_connection_stays_usable(slow_server: EngineServer) -> None:
    connection = http.client.HTTPConnection(slow_server.url.removeprefix("http://"), timeout=10)
    try:
        for body, status in [({"messages": []}, 400), ({"prompt": "hello"}, 200), ({}, 400), ({"prompt": "a"}, 200)]:
            connection.request("POST", "/tokenize", json.dumps(body), {"content-type": "application/json"})
            response = connection.getresponse()
            payload = json.loads(response.read())
            assert response.status == status, payload
            if status == 400:
                assert payload["error"]["type"] == "invalid_request_error" and payload["error"]["code"] == 400
    finally:
        connection.close()


def test_an_unexpected_exception_is_a_json_500_with_a_request_id() -> None:
    async def broken_app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http" and scope["path"] == "/boom":
            raise KeyError("a bug")
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with ServerThread(ErrorGuard(broken_app), free_port()) as running, httpx.Client() as client:
        for _ in range(2):  # the same connection serves on after the failure
            failed = client.get(f"{running.url}/boom", headers={"x-request-id": "req-42"})
            assert failed.status_code == 500
            assert failed.json()["error"]["code"] == 500 and "req-42" in failed.json()["error"]["message"]
            assert failed.headers["x-request-id"] == "req-42"
            assert client.get(f"{running.url}/fine").text == "ok"


def test_a_dead_engine_leaves_redis_fails_health_and_stops_the_server(
    tiny_llama: Path, redis_server: RedisProcess
) -> None:
    settings = ServerSettings(
        model=str(tiny_llama), port=free_port(), redis_url=redis_server.url, replica_id="doomed", exit_grace=0.5
    )
    engine = AsyncEngine(model=str(tiny_llama), dtype="float32", block_size=8, num_kv_blocks=64)
    running: ServerThread | None = None

    def stop_server() -> None:
        assert running is not None
        running.server.should_exit = True

    app = create_app(settings, engine=engine, stop_server=stop_server)
    running = ServerThread(app, settings.port)
    store = redis.Redis.from_url(redis_server.url)
    key = record_key(settings.model_name, "doomed")
    with running:
        wait_for(lambda: store.exists(key))
        assert httpx.get(f"{running.url}/health").status_code == 200

        def forward_pass_fails(*_: object) -> None:
            raise RuntimeError("injected: the device fell off the bus")

        engine._engine.runner.execute = forward_pass_fails  # type: ignore[method-assign]  # a fault, injected past the door
        answer = httpx.post(
            f"{running.url}/v1/completions",
            json={"model": settings.model_name, "prompt": "hi", "max_tokens": 3},
            timeout=10,
        )
        assert answer.status_code == 503 and "engine stopped" in answer.json()["error"]["message"]
        died = time.monotonic()
        wait_for(lambda: not store.exists(key), timeout=3.0)
        health = httpx.get(f"{running.url}/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == 503
        running.thread.join(timeout=15)
        assert not running.thread.is_alive(), "the server did not stop after its engine died"
        assert time.monotonic() - died < 10
    assert app.state.server.exit_code == EXIT_ENGINE_DEAD
    assert not store.exists(key), "a report came after the record was withdrawn"
