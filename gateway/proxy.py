"""Forwarding one OpenAI request to a replica, with failover before the first byte.

One shared aiohttp session (an upstream call costs a third of httpx's here); hop-by-hop
headers and the client's API key are not forwarded; a request id is added. A JSON answer is
read whole and sent in one write; an SSE stream is relayed chunk by chunk without
buffering. Responses are written straight to ASGI: this is the hot path.

Failure rules: only a failure of the replica itself (a connection error, a timeout, or a
503 before the first byte) moves the request to another replica; any other answer, a 4xx
or a 500 included, is the request's own and goes to the client as it is. A replica is
skipped for a while only after several such failures in a row (`OutlierDetector`), so one
bad request cannot take replicas out. A client that goes away at any point closes the
upstream connection, which aborts the request on the replica (`until_disconnected`).
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.routing import RoutedRequest, RoutingPolicy
from pagefleet.protocol.http import error_json
from pagefleet.protocol.openai import error_response

logger = logging.getLogger(__name__)

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "authorization",  # the gateway's key stays at the gateway
}
_CHARS_PER_TOKEN = 4  # a rough estimate of a prompt's tokens from its text
_DEFAULT_CHAT_TOKENS = 256  # what a chat request without max_tokens is assumed to take
PREFIX_CHARS = 256


@dataclass(slots=True)
class RequestShape:
    """What routing needs to know of a request body."""

    model: str
    prompt_tokens: int
    max_tokens: int
    num_sequences: int
    prefix: str

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens * self.num_sequences

    def blocks(self, block_size: int) -> int:
        return math.ceil(self.prompt_tokens / block_size) + self.num_sequences * math.ceil(self.max_tokens / block_size)


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _text_tokens(value: Any) -> tuple[int, str]:
    """(estimated tokens, text start) of a prompt: a string, token ids, or a list of either."""
    if isinstance(value, str):
        return max(1, len(value) // _CHARS_PER_TOKEN), value[:PREFIX_CHARS]
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return len(value), ",".join(map(str, value[:64]))
    if isinstance(value, list):
        parts = [_text_tokens(item) for item in value]
        return sum(p[0] for p in parts), (parts[0][1] if parts else "")
    return 0, ""


def describe(body: bytes, chat: bool) -> RequestShape:
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise BadRequest("the request body is not valid JSON") from exc
    if not isinstance(payload, dict):
        raise BadRequest("the request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: a model name is required", "model")
    if chat:
        messages = payload.get("messages") or []
        texts = [str(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
        prompt_tokens, prefix = _text_tokens("\n".join(texts))
        max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or _DEFAULT_CHAT_TOKENS
    else:
        prompt_tokens, prefix = _text_tokens(payload.get("prompt", ""))
        max_tokens = payload.get("max_tokens") or 16
    num = payload.get("best_of") or payload.get("n") or 1
    if not isinstance(max_tokens, int) or not isinstance(num, int):
        raise BadRequest("max_tokens and n must be integers", "max_tokens")
    return RequestShape(model, prompt_tokens, max(1, max_tokens), max(1, num), prefix)


class OutlierDetector:
    """Skips a replica for `exclude_for` seconds after `threshold` consecutive failures of
    its own (as Envoy's outlier detection does); any answer that is not one resets the
    count."""

    def __init__(self, registry: ReplicaRegistry, threshold: int, exclude_for: float) -> None:
        self.registry, self.threshold, self.exclude_for = registry, threshold, exclude_for
        self._failures: dict[str, int] = {}  # replica url -> consecutive failures

    def failed(self, url: str) -> bool:
        """Count a failure; True if the replica is now skipped."""
        count = self._failures.get(url, 0) + 1
        if count < self.threshold:
            self._failures[url] = count
            return False
        self._failures.pop(url, None)
        self.registry.exclude(url, self.exclude_for)
        return True

    def succeeded(self, url: str) -> None:
        if self._failures:
            self._failures.pop(url, None)


class Proxy:
    def __init__(self, registry: ReplicaRegistry, metrics: GatewayMetrics, attempts: int, outliers: OutlierDetector):
        self.session: aiohttp.ClientSession | None = None  # opened inside the server's loop (start)
        self.registry, self.metrics = registry, metrics
        self.attempts, self.outliers = attempts, outliers

    async def start(self, connect_timeout: float, read_timeout: float) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout, sock_read=read_timeout)
        connector = aiohttp.TCPConnector(limit=1000, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def forward(
        self, path: str, body: bytes, headers: dict[str, str], shape: RequestShape, policy: RoutingPolicy
    ) -> ASGIResponse:
        assert self.session is not None, "Proxy.start() opens the session"
        request_id = headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
        forwarded = {k: v for k, v in headers.items() if k not in HOP_BY_HOP} | {"x-request-id": request_id}
        tried: set[str] = set()
        model = shape.model
        for _ in range(self.attempts):
            candidates = self.registry.candidates(model, skip=tried)
            if not candidates:
                break
            routed = RoutedRequest(model, shape.blocks(candidates[0].block_size), shape.prefix)
            route = await policy.choose(candidates, routed)
            if route is None:
                break
            replica = route.replica
            tried.add(replica.url)
            self.metrics.routing_decisions.labels(model, replica.replica_id, policy.name).inc()
            started = time.monotonic()
            try:
                upstream = await self.session.post(replica.url + path, data=body, headers=forwarded)
            except (aiohttp.ClientError, TimeoutError) as exc:
                await self._failed(route.release, model, replica.replica_id, replica.url, repr(exc))
                continue
            if upstream.status == 503:  # the replica cannot take it now (full, loading, stopped)
                upstream.release()
                await self._failed(route.release, model, replica.replica_id, replica.url, "HTTP 503")
                continue
            self.outliers.succeeded(replica.url)
            self.metrics.upstream_latency.labels(model, replica.replica_id).observe(time.monotonic() - started)
            self.metrics.requests.labels(model, replica.replica_id, str(upstream.status)).inc()
            extra = [(b"x-request-id", request_id.encode()), (b"x-pagefleet-replica", replica.replica_id.encode())]
            return Relay(upstream, request_id, extra)
        self.metrics.errors.labels(model, "no_replica").inc()
        return error_json(
            503, f"No replica of `{model}` could take the request; retry shortly.", headers={"Retry-After": "1"}
        )

    async def _failed(self, release: Any, model: str, replica_id: str, url: str, reason: str) -> None:
        await release()
        skipped = self.outliers.failed(url)
        self.metrics.failovers.labels(model, replica_id).inc()
        logger.warning(
            "replica %s failed before the first byte (%s); trying another%s",
            replica_id,
            reason,
            f"; skipping it for {self.outliers.exclude_for:g} s" if skipped else "",
        )


class Relay:
    """The replica's response, written to the client as an ASGI response."""

    def __init__(self, upstream: aiohttp.ClientResponse, request_id: str, extra: list[tuple[bytes, bytes]]) -> None:
        self.upstream, self.request_id = upstream, request_id
        kept = [(k, v) for k, v in upstream.raw_headers if k.decode("latin-1").lower() not in HOP_BY_HOP]
        self.headers = kept + extra
        self.streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        completed = False
        try:
            if self.streaming:
                await self._relay(send)
            else:
                body = await self.upstream.read()
                headers = self.headers + [(b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": self.upstream.status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            completed = True
        finally:
            # Read to the end: the connection goes back to the pool. Otherwise (the client
            # left, the relay failed) it is closed, which aborts the request upstream.
            self.upstream.release() if completed else self.upstream.close()

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.upstream.status, "headers": self.headers})
        try:
            async for chunk in self.upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as exc:  # after the first byte: say so in the stream
            logger.warning("request %s: the replica failed mid-response: %r", self.request_id, exc)
            message = error_response(502, "The replica failed during the response.")
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(message)}\n\n".encode(), "more_body": True}
            )
        await send({"type": "http.response.body", "body": b""})


ASGIResponse = Relay | JSONResponse
