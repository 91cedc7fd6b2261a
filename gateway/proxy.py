"""Forwarding one OpenAI request to a replica, with failover before the first byte.

Upstream calls go through the gateway's own keep-alive client (gateway/upstream.py);
hop-by-hop headers and the client's API key are not forwarded; a request id is added. A
JSON answer is read whole and sent in one write; an SSE stream is relayed chunk by chunk
without buffering. Responses are written straight to ASGI: this is the hot path.

Failure rules: only a failure of the replica itself (a connection error, a timeout, or a
503 before the first byte) moves the request to another replica; any other answer, a 4xx
or a 500 included, is the request's own and goes to the client as it is. A replica is
skipped for a while only after several such failures in a row (`OutlierDetector`), so one
bad request cannot take replicas out. A client that goes away at any point closes the
upstream connection, which aborts the request on the replica (`until_disconnected`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.trace import Span
from starlette.types import Send

from pagefleet.gateway import errors
from pagefleet.gateway.disaggregation import (
    PREFILL_REPLICA_HEADER,
    Prefilled,
    decode_body,
    prefill_body,
    transfer_params,
)
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.route import kv_peer_of
from pagefleet.gateway.routing import Route, Router
from pagefleet.gateway.shape import RequestShape
from pagefleet.gateway.tracing import ProxyTracing
from pagefleet.gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from pagefleet.protocol.headers import KV_PEER_HEADER
from pagefleet.protocol.openai import error_response
from pagefleet.runtime.tracing import TRACE_HEADERS

logger = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"authorization",  # the gateway's key stays at the gateway
    }
)
_NOT_FORWARDED = HOP_BY_HOP | {b"x-request-id", KV_PEER_HEADER.encode()}  # the peer is the gateway's to name
# The routes whose requests carry vLLM's kv_transfer_params; Anthropic's go whole to a replica.
_DISAGGREGATED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')


def forwarded_headers(headers: list[tuple[bytes, bytes]], request_id: bytes, traced: bool = False) -> bytes:
    """The client's end-to-end headers (lower-case names, as ASGI gives them) as header
    lines for the replica, with the request id. `traced`: the gateway's own spans carry
    the trace on, so the client's `traceparent` is not passed as it came."""
    dropped = _NOT_FORWARDED | TRACE_HEADERS if traced else _NOT_FORWARDED
    lines = [b"%s: %s\r\n" % (name, value) for name, value in headers if name not in dropped]
    return b"".join(lines) + b"x-request-id: " + request_id + b"\r\n"


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


def upstream_headers(headers: bytes, route: Route, trace_lines: bytes = b"") -> bytes:
    """The header lines a replica gets: the client's (forwarded_headers), the peer to pull
    the prompt's prefix from when the route names one, and the trace's context."""
    peer = kv_peer_of(route)
    if peer is not None:
        headers += b"%s: %s\r\n" % (KV_PEER_HEADER.encode(), peer.encode("latin-1"))
    return headers + trace_lines


class Proxy:
    def __init__(
        self,
        router: Router,
        pool: UpstreamPool,
        outliers: OutlierDetector,
        metrics: GatewayMetrics,
        attempts: int,
        tracing: ProxyTracing | None = None,
    ) -> None:
        self.router, self.pool, self.outliers, self.metrics = router, pool, outliers, metrics
        self.attempts, self.tracing = attempts, tracing

    async def forward(self, path: str, body: bytes, headers: bytes, shape: RequestShape, request_id: bytes) -> Relay:
        """The first replica's answer that is not a failure of its own; raises a Refusal
        (503) when no replica of the model could take the request.

        A model with prefill and decode replicas is served disaggregated (OpenAI's routes): the prompt on a
        prefill replica, then the request on a decode replica that pulls the prompt's KV.
        If that fails before the first byte (no prefill replica left, a failed pull), one
        replica runs the whole request.

        A LoRA adapter that no live replica serves but the catalog knows is loaded first on
        the best replica of its base model."""
        await self.ensure_adapter(shape, headers)
        if self.router.is_disaggregated(shape.model) and path in _DISAGGREGATED_PATHS:
            relay = await self._forward_disaggregated(path, body, headers, shape, request_id)
            self.metrics.disaggregated.labels(shape.model, "paired" if relay else "fallback").inc()
            if relay is not None:
                return relay
        relay = await self._forward(path, body, headers, shape, request_id, "whole")
        if relay is None:
            raise self.metrics.refused(errors.no_replica(shape.model))
        return relay

    async def _forward(
        self,
        path: str,
        body: bytes,
        headers: bytes,
        shape: RequestShape,
        request_id: bytes,
        phase: str,
        extra: tuple[tuple[bytes, bytes], ...] = (),
    ) -> Relay | None:
        """The first answer of a `phase` replica that is not a failure of its own, or None.
        A decode replica's 502 (its KV pull failed) is such a failure too."""
        tried: set[str] = set()
        model = shape.model
        for _ in range(self.attempts):
            route = await self._pick(shape, tried, phase)
            if route is None:
                return None
            replica = route.replica
            tried.add(replica.url)
            started = time.monotonic()
            span, trace_lines = self.tracing.call(path, replica, phase) if self.tracing is not None else (None, b"")
            sent_headers = upstream_headers(headers, route, trace_lines)
            try:
                upstream = await self.pool.post(replica.url, path, body, sent_headers)
            except (UpstreamError, TimeoutError) as exc:
                await self._failed(route, str(exc) or repr(exc), span)
                continue
            # 503: the replica cannot take it now (full, loading, stopped).
            if upstream.status == 503 or (phase == "decode" and upstream.status == 502):
                upstream.close()
                await self._failed(route, f"HTTP {upstream.status}", span)
                continue
            self.outliers.succeeded(replica.url)
            self.metrics.upstream_latency.labels(model, replica.replica_id).observe(time.monotonic() - started)
            self.metrics.requests.labels(model, replica.replica_id, str(upstream.status)).inc()
            headers_out = [(b"x-request-id", request_id), (b"x-pagefleet-replica", replica.replica_id.encode())]
            if span is not None:
                ProxyTracing.answered(span, upstream.status)
            counter = self.metrics.cached_prompt_tokens.labels(model, replica.replica_id)
            return Relay(upstream, request_id.decode("latin-1"), [*headers_out, *extra], span, counter.inc)
        return None

    async def _pick(self, shape: RequestShape, tried: set[str], phase: str) -> Route | None:
        if self.tracing is None:
            return await self.router.pick(shape, tried, phase)
        with self.tracing.routing(shape.model, phase) as span:
            route = await self.router.pick(shape, tried, phase)
            span.chosen(route)
            return route

    async def prefill(
        self, path: str, payload: dict[str, Any], headers: bytes, shape: RequestShape, request_id: bytes
    ) -> Prefilled | None:
        """Run a disaggregated request's prompt on a prefill replica (failing over like any
        request); None when none did. The picker calls this too, then lets Envoy send the
        decode request."""
        prefill = await self._forward(path, prefill_body(payload), headers, shape, request_id, "prefill")
        if prefill is None:
            return None
        answer = await prefill.upstream.read()
        prefill.upstream.release()
        if prefill.span is not None:
            prefill.span.end()
        transfer = transfer_params(answer) if prefill.upstream.status == 200 else None
        if transfer is None:  # its own error (the request's): the whole request says it again
            return None
        return Prefilled(transfer, dict(prefill.headers).get(b"x-pagefleet-replica", b"").decode())

    async def _forward_disaggregated(
        self, path: str, body: bytes, headers: bytes, shape: RequestShape, request_id: bytes
    ) -> Relay | None:
        """Prefill, then decode; None when either finds no replica that does its part."""
        payload = json.loads(body)
        prefilled = await self.prefill(path, payload, headers, shape, request_id)
        if prefilled is None:
            return None
        extra = ((PREFILL_REPLICA_HEADER.encode(), prefilled.replica_id.encode()),)
        decode = decode_body(payload, prefilled.transfer)
        return await self._forward(path, decode, headers, shape, request_id, "decode", extra)

    async def ensure_adapter(self, shape: RequestShape, headers: bytes) -> None:
        """If `shape.model` is a LoRA adapter that the catalog knows but no live replica
        serves, load it on the replica of its base model that the policy picks; a failure
        is logged (the request then finds no replica). The picker calls this too."""
        unserved = self.router.registry.unserved_adapter(shape.model)
        if unserved is None:
            return
        base, adapter_path = unserved
        route = await self.router.pick(dataclasses.replace(shape, model=base), set())
        if route is None:
            return
        await route.release()  # the request itself reserves when it is routed
        replica = route.replica
        body = json.dumps({"lora_name": shape.model, "lora_path": adapter_path}).encode()
        try:
            answer = await self.pool.post(replica.url, "/v1/load_lora_adapter", body, headers)
            text = await answer.read()
            answer.release()
        except (UpstreamError, TimeoutError) as exc:
            logger.warning("could not load adapter %s on %s: %r", shape.model, replica.replica_id, exc)
            return
        if answer.status == 200 or b"already been loaded" in text:
            logger.info("loaded adapter %s on %s (no replica served it)", shape.model, replica.replica_id)
            self.router.registry.note_adapter(replica.url, shape.model)
        else:
            logger.warning("replica %s refused adapter %s: %s", replica.replica_id, shape.model, text[:300])

    async def _failed(self, route: Route, reason: str, span: Span | None = None) -> None:
        if span is not None:
            ProxyTracing.failed(span, reason)
        await route.release()
        replica = route.replica
        skipped = self.outliers.failed(replica.url)
        self.metrics.failovers.labels(replica.model, replica.replica_id).inc()
        logger.warning(
            "replica %s failed before the first byte (%s); trying another%s",
            replica.replica_id,
            reason,
            f"; skipping it for {self.outliers.exclude_for:g} s" if skipped else "",
        )


class Relay:
    """The replica's response, to be written to the client over ASGI."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        request_id: str,
        extra: list[tuple[bytes, bytes]],
        span: Span | None = None,
        count_cached: Callable[[int], None] | None = None,
    ) -> None:
        self.upstream, self.request_id, self.span = upstream, request_id, span  # span: the call, ended when relayed
        self.count_cached = count_cached  # the usage's cached prompt tokens, as the replica reports them
        kept = [(k, v) for k, v in upstream.raw_headers if k.lower() not in _NOT_FORWARDED]
        self.headers = kept + extra
        self.streaming = upstream.header(b"content-type").startswith(b"text/event-stream")

    async def send_to(self, send: Send) -> None:
        completed = False
        try:
            if self.streaming:
                await self._relay(send)
            else:
                body = await self.upstream.read()
                self._count_cached(body)
                headers = self.headers + [(b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": self.upstream.status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
            completed = True
        finally:
            # Read to the end: the connection goes back to the pool. Otherwise (the client
            # left, the relay failed) it is closed, which aborts the request upstream.
            self.upstream.release() if completed else self.upstream.close()
            if self.span is not None:
                self.span.end()

    def _count_cached(self, data: bytes) -> None:
        if self.count_cached is not None and b'"cached_tokens"' in data:
            found = _CACHED_TOKENS.search(data)
            if found is not None:
                self.count_cached(int(found.group(1)))

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.upstream.status, "headers": self.headers})
        try:
            async for chunk in self.upstream.chunks():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._count_cached(chunk)  # a stream's usage comes last, when the client asked for it
        except (UpstreamError, TimeoutError) as exc:  # after the first byte: say so in the stream
            logger.warning("request %s: the replica failed mid-response: %r", self.request_id, exc)
            message = error_response(502, "The replica failed during the response.")
            await send(
                {"type": "http.response.body", "body": f"data: {json.dumps(message)}\n\n".encode(), "more_body": True}
            )
        await send({"type": "http.response.body", "body": b""})
