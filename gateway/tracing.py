"""The gateway's spans inside one traced request (runtime/tracing.py makes the request's
SERVER span): `route` for each routing decision (policy, candidates, chosen replica, KV
blocks reserved) and a CLIENT span for each call to a replica, whose `traceparent` the
replica continues. A failover shows as a failed call and a second `route`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace

from pagefleet.gateway.routing import Route
from pagefleet.protocol.replica import ReplicaRecord
from pagefleet.runtime.tracing import trace_headers


class ProxyTracing:
    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    @contextlib.contextmanager
    def routing(self, model: str, phase: str) -> Iterator[RouteSpan]:
        attributes = {"gen_ai.request.model": model, "pagefleet.routing.phase": phase}
        with self.tracer.start_as_current_span("route", attributes=attributes) as span:
            yield RouteSpan(span)

    def call(self, path: str, replica: ReplicaRecord, phase: str) -> tuple[trace.Span, bytes]:
        """A CLIENT span for one call to `replica`, and the header lines that continue it there."""
        host, _, port = replica.url.split("://", 1)[-1].rstrip("/").partition(":")
        span = self.tracer.start_span(
            f"POST {path}",
            kind=trace.SpanKind.CLIENT,
            attributes={
                "http.request.method": "POST",
                "url.full": f"{replica.url.rstrip('/')}{path}",
                "server.address": host,
                "server.port": int(port) if port.isdigit() else 80,
                "pagefleet.replica.id": replica.replica_id,
                "pagefleet.routing.phase": phase,
            },
        )
        with trace.use_span(span, end_on_exit=False):
            lines = b"".join(b"%s: %s\r\n" % header for header in trace_headers())
        return span, lines

    @staticmethod
    def answered(span: trace.Span, status: int) -> None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(trace.StatusCode.ERROR, f"HTTP {status}")

    @staticmethod
    def failed(span: trace.Span, reason: str) -> None:
        span.set_attribute("error.type", reason)
        span.set_status(trace.StatusCode.ERROR, reason)
        span.end()


class RouteSpan:
    def __init__(self, span: trace.Span) -> None:
        self.span = span

    def chosen(self, route: Route | None) -> None:
        if route is None:
            self.span.set_attribute("pagefleet.routing.outcome", "no_replica")
            return
        self.span.set_attributes(
            {
                "pagefleet.routing.policy": route.policy,
                "pagefleet.routing.candidates": route.num_candidates,
                "pagefleet.replica.id": route.replica.replica_id,
                "pagefleet.replica.url": route.replica.url,
                "pagefleet.routing.reserved_blocks": route.reserved_blocks,
                "pagefleet.replica.free_blocks": route.replica.free_blocks,
            }
        )
        if route.reason:
            self.span.set_attribute("pagefleet.routing.reason", route.reason)
