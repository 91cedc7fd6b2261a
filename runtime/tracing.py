"""OpenTelemetry tracing as the gateway and the engine server share it: off unless an OTLP
endpoint is given (`--otlp-traces-endpoint`, vLLM's flag), W3C `traceparent` taken from a
request and passed on to the next hop, one SERVER span per traced HTTP request.

The exporter speaks OTLP over gRPC, or over HTTP when `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`
is `http/protobuf` (as vLLM reads it); the other standard `OTEL_*` variables (headers,
service name, resource attributes) apply too.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})


def otlp_exporter(endpoint: str) -> SpanExporter:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=url)
    raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: use grpc or http/protobuf")


def tracer_provider(service_name: str, endpoint: str | None) -> TracerProvider | None:
    """A provider exporting to `endpoint` in batches; None (tracing off) without one."""
    if not endpoint:
        return None
    provider = TracerProvider(resource=_resource(service_name))
    provider.add_span_processor(BatchSpanProcessor(otlp_exporter(endpoint)))
    return provider


def _resource(service_name: str) -> Resource:
    """`service_name` unless the environment names the service (`OTEL_SERVICE_NAME`, or
    `service.name` in `OTEL_RESOURCE_ATTRIBUTES`), as every OpenTelemetry SDK lets it."""
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": service_name}))
    return resource


def trace_headers() -> list[tuple[bytes, bytes]]:
    """`traceparent` (and `tracestate`) of the current span, for an outgoing request."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return [(name.encode(), value.encode("latin-1")) for name, value in carrier.items()]


class ServerSpans:
    """ASGI middleware: a SERVER span for each request to `paths`, child of the caller's
    `traceparent` (if any) and current while the app handles it, so the app's own spans
    and outgoing calls join the trace."""

    def __init__(self, app: ASGIApp, tracer: trace.Tracer, paths: Iterable[str]) -> None:
        self.app, self.tracer, self.paths = app, tracer, frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        parent = propagate.extract(carrier)
        method, path = scope["method"], scope["path"]
        attributes = {"http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme", "http")}
        with self.tracer.start_as_current_span(
            f"{method} {path}", context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
        ) as span:

            async def traced_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(trace.StatusCode.ERROR)
                await send(message)

            await self.app(scope, receive, traced_send)
