"""The HTTP side of sending a request to a replica: the header lines it gets, the answer
relayed to the client, and which replicas to skip after failures. The director
(director.py) decides where each request goes and fails over before the first byte.

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

import json
import logging
import re
from collections.abc import Callable

from opentelemetry.trace import Span
from starlette.types import Send

from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.route import kv_peer_of
from pagefleet.gateway.routing import Route
from pagefleet.gateway.upstream import UpstreamError, UpstreamResponse
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
