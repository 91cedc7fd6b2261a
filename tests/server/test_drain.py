"""SIGTERM drains a replica: it leaves Redis at once, stays live but not ready, refuses new
requests with a 503 the gateway retries elsewhere, lets the requests in flight finish
(streams included), and exits 0. A request that outlives `--shutdown-timeout` ends with an
error in its API's shape, never a cut stream. Real `pagefleet serve` processes, a real
SIGTERM, a real Redis."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import redis

from pagefleet.protocol.replica import record_key
from tests.processes import EngineServer, RedisProcess, start_server, wait_for

MAX_TOKENS = 450  # about 3 s of tokens on the slow model (512 positions): the drain starts well before the end
STREAM_TOKENS = 200  # the stream only has to outlast the chat queueing behind it


def _serve(
    slow_llama: Path, log: Path, redis_url: str, shutdown_timeout: float, extra: tuple[str, ...] = ()
) -> EngineServer:
    return start_server(
        str(slow_llama), log, "--dtype", "float32", "--num-kv-blocks", "512", "--block-size", "8",
        "--redis-url", redis_url, "--replica-id", "draining", "--publish-interval", "0.2",
        "--shutdown-timeout", str(shutdown_timeout), *extra,
    )  # fmt: skip


def _num_waiting(server: EngineServer) -> float:
    """vLLM's gauge of queued requests, as the replica's /metrics reports it."""
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_waiting{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_waiting in /metrics")


def _stream(server: EngineServer, started: threading.Event, max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    """A streamed completion's events, read to the end; `started` is set at its first."""
    body = {"model": server.model, "prompt": "Tell me a long story:", "max_tokens": max_tokens}
    events = []
    body |= {"ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append({"done": True} if line == "data: [DONE]" else json.loads(line[6:]))
                started.set()
    return events


def _in_background(target: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(target(*args)), daemon=True)
    thread.start()
    return thread, result


def _chat(server: EngineServer) -> httpx.Response:
    body = {"model": server.model, "messages": [{"role": "user", "content": "A story, please."}]}
    body |= {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_sigterm_lets_every_request_in_flight_finish_then_exits_0(
    slow_llama: Path, redis_server: RedisProcess, tmp_path: Path
) -> None:
    # One sequence at a time: the chat queues behind the stream, so when the drain begins both
    # are in flight and the chat stays so for its whole length after the stream ends.
    extra = ("--max-num-seqs", "1")
    server = _serve(slow_llama, tmp_path / "serve.log", redis_server.url, shutdown_timeout=60, extra=extra)
    store = redis.Redis.from_url(redis_server.url)
    key = record_key(server.model, "draining")
    wait_for(lambda: store.exists(key))
    started = threading.Event()
    streaming, streamed = _in_background(_stream, server, started, STREAM_TOKENS)
    assert started.wait(30)
    plain, answered = _in_background(_chat, server)
    wait_for(lambda: _num_waiting(server) == 1)

    server.process.send_signal(signal.SIGTERM)
    # Routers stop sending work at once: within seconds, even on a loaded machine.
    wait_for(lambda: not store.exists(key), timeout=15.0)
    assert httpx.get(f"{server.url}/health").status_code == 200  # live: not restarted mid-drain
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 503 and "shutting down" in ready.json()["error"]["message"]
    late = httpx.post(f"{server.url}/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2})
    assert late.status_code == 503 and late.headers["retry-after"] == "1"
    assert late.json()["error"]["code"] == 503  # OpenAI's shape: the gateway retries it elsewhere
    assert plain.is_alive(), "the requests ended before the drain's checks: nothing tested"

    streaming.join(60)
    plain.join(60)
    events = streamed[0]
    assert events[-1] == {"done": True}
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")]
    assert finishes[-1] == "length" and not any("error" in e for e in events)
    (chat,) = answered
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == MAX_TOKENS
    assert server.process.wait(timeout=30) == 0
    assert not store.exists(key), "a report came after the record was withdrawn"


def test_a_request_that_outlives_the_drain_ends_with_an_error_not_a_cut(
    slow_llama: Path, redis_server: RedisProcess, tmp_path: Path
) -> None:
    server = _serve(slow_llama, tmp_path / "serve.log", redis_server.url, shutdown_timeout=0.5)
    started = threading.Event()
    streaming, streamed = _in_background(_stream, server, started)
    plain, answered = _in_background(_chat, server)
    assert started.wait(30)
    server.process.send_signal(signal.SIGTERM)
    streaming.join(30)
    plain.join(30)
    events = streamed[0]
    assert events[-1] == {"done": True}
    error = events[-2]["error"]
    assert error["code"] == 503 and "did not finish within 0.5 s" in error["message"]
    (chat,) = answered
    assert chat.status_code == 503 and "shutting down" in chat.json()["error"]["message"]
    assert server.process.wait(timeout=30) == 0
