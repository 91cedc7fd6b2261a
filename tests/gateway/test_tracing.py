"""OpenTelemetry traces across the gateway and a replica: both apps in this process (so one
in-memory exporter sees every span), each on its own real HTTP server, with a real Redis."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry import propagate, trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import (
    TraceServiceServicer,
    add_TraceServiceServicer_to_server,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagefleet.engine.server.app import create_app as create_engine_app
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.gateway.app import create_app as create_gateway_app
from pagefleet.gateway.settings import GatewaySettings
from tests.gateway.conftest import start_replica
from tests.processes import (
    RedisProcess,
    ServerThread,
    free_port,
    start_gateway,
    stop_process,
    stop_server,
    wait_for,
)

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in blocks."


@dataclass
class TracedFleet:
    gateway: ServerThread
    exporter: InMemorySpanExporter
    provider: TracerProvider

    def spans(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.exporter.get_finished_spans() if span.name == name]


@pytest.fixture
def traced(tiny_llama: Path, redis_server: RedisProcess) -> Iterator[TracedFleet]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    port = free_port()
    engine = ServerSettings(
        model=str(tiny_llama), served_model_name="tiny", port=port, redis_url=redis_server.url,
        replica_id="traced-a", dtype="float32", block_size=8, num_kv_blocks=64,
        max_num_batched_tokens=16,  # a prompt of ~40 tokens is prefilled in three chunks
    )  # fmt: skip
    gateway = GatewaySettings(redis_url=redis_server.url, port=free_port())
    with (
        ServerThread(create_engine_app(engine, tracer_provider=provider), port),
        ServerThread(create_gateway_app(gateway, tracer_provider=provider), gateway.port) as running_gateway,
    ):
        wait_for(lambda: "tiny" in httpx.get(f"{running_gateway.url}/health").json().get("models", []), timeout=60)
        yield TracedFleet(running_gateway, exporter, provider)


def test_one_request_through_the_gateway_is_one_trace_linking_gateway_and_replica(traced: TracedFleet) -> None:
    client = traced.provider.get_tracer("the-application")
    with client.start_as_current_span("application call") as application:
        headers: dict[str, str] = {}
        propagate.inject(headers)  # W3C traceparent, as an instrumented client sends it
        answer = httpx.post(
            f"{traced.gateway.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5},
            headers=headers,
            timeout=60,
        )
    assert answer.status_code == 200
    wait_for(lambda: traced.spans("llm_request") and len(traced.spans("POST /v1/chat/completions")) == 3)
    trace_id = application.get_span_context().trace_id
    spans = [span for span in traced.exporter.get_finished_spans() if span.context.trace_id == trace_id]
    by_id = {span.context.span_id: span for span in spans}

    def parent(span: ReadableSpan) -> ReadableSpan:
        assert span.parent is not None, f"{span.name} has no parent"
        return by_id[span.parent.span_id]

    # gateway SERVER <- application; route and CLIENT <- gateway SERVER; replica SERVER <- CLIENT
    (gateway_server,) = [s for s in spans if s.kind == trace.SpanKind.SERVER and parent(s).name == "application call"]
    (route,) = [s for s in spans if s.name == "route"]
    (call,) = [s for s in spans if s.kind == trace.SpanKind.CLIENT]
    (replica_server,) = [s for s in spans if s.kind == trace.SpanKind.SERVER and s is not gateway_server]
    (request,) = [s for s in spans if s.name == "llm_request"]
    assert parent(route) is gateway_server and parent(call) is gateway_server
    assert parent(replica_server) is call and parent(request) is replica_server
    assert len({span.context.trace_id for span in traced.exporter.get_finished_spans()}) == 1

    assert gateway_server.attributes["gen_ai.request.model"] == "tiny"
    assert gateway_server.attributes["gen_ai.operation.name"] == "chat"
    assert gateway_server.attributes["http.response.status_code"] == 200
    assert route.attributes["pagefleet.routing.policy"] == "affinity"
    assert route.attributes["pagefleet.routing.reason"] in ("affinity", "saturated", "session", "load")
    assert route.attributes["pagefleet.replica.id"] == "traced-a"
    assert route.attributes["pagefleet.routing.reserved_blocks"] > 0
    assert call.attributes["pagefleet.replica.id"] == "traced-a" and call.attributes["http.response.status_code"] == 200
    assert replica_server.attributes["http.response.status_code"] == 200

    attributes = request.attributes
    assert attributes["gen_ai.request.model"] == "tiny" and attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.max_tokens"] == 5
    # One request id from the gateway to the engine: the response's id and the engine's log id.
    gateway_id = gateway_server.attributes["pagefleet.request_id"]
    assert answer.headers["x-request-id"] == gateway_id
    assert attributes["gen_ai.response.id"] == answer.json()["id"] == f"chatcmpl-{gateway_id}"
    assert attributes["pagefleet.request_id"].startswith(f"chatcmpl-{gateway_id}-0-")
    usage = answer.json()["usage"]
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 32
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert 0 < attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]
    events = [event.name for event in request.events]
    chunks = [event for event in request.events if event.name == "prefill_chunk"]
    assert events[0] == "scheduled" and events[-1] == "finished" and "first_token" in events
    assert sum(event.attributes["tokens"] for event in chunks) == usage["prompt_tokens"]
    assert len(chunks) == -(-usage["prompt_tokens"] // 16)  # the token budget per step
    assert [event.attributes["start"] for event in chunks] == [16 * i for i in range(len(chunks))]
    times = [event.timestamp for event in request.events]
    assert times == sorted(times) and request.start_time <= times[0] and times[-1] <= request.end_time
    assert gateway_server.start_time <= replica_server.start_time <= request.start_time


def test_a_request_the_replica_refuses_is_traced_with_its_status(traced: TracedFleet) -> None:
    answer = httpx.post(f"{traced.gateway.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "n": 0})
    assert answer.status_code == 400
    wait_for(lambda: len(traced.spans("POST /v1/completions")) == 3)
    spans = traced.spans("POST /v1/completions")
    assert {span.attributes["http.response.status_code"] for span in spans} == {400}
    assert [span.kind for span in spans if span.parent is None] == [trace.SpanKind.SERVER]  # no traceparent sent
    assert not traced.spans("llm_request")  # refused before the engine saw it


class Collector(TraceServiceServicer):
    """An OTLP/gRPC trace receiver, as an OpenTelemetry Collector listens on 4317."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, OTLP span)

    def Export(self, request: Any, context: Any) -> ExportTraceServiceResponse:  # noqa: N802 - the gRPC method's name
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            self.spans += [(service, span) for scope in resource_spans.scope_spans for span in scope.spans]
        return ExportTraceServiceResponse()


def test_the_otlp_flag_sends_the_gateway_and_replica_spans_to_a_collector(
    tiny_llama: Path, redis_server: RedisProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collector = Collector()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    add_TraceServiceServicer_to_server(collector, server)
    endpoint = f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export batches every 0.1 s, not 5 s
    flags = ("--otlp-traces-endpoint", endpoint)
    replica = start_replica(tiny_llama, tmp_path, redis_server, "otlp-a", *flags)
    gateway = start_gateway(redis_server.url, tmp_path / "gateway.log", *flags)
    try:
        wait_for(lambda: "tiny" in httpx.get(f"{gateway.url}/health").json().get("models", []), timeout=30)
        trace_id = os.urandom(16).hex()
        answer = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 3},
            headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
            timeout=60,
        )
        assert answer.status_code == 200

        expected = {
            "pagefleet-gateway": {"POST /v1/completions", "route"},
            "pagefleet-engine": {"POST /v1/completions", "llm_request"},
        }

        def ours() -> dict[str, set[str]]:
            """Our trace's spans by service, once all have arrived: each process exports in
            batches of its own, and the gateway's SERVER span ends only after the answer."""
            found: dict[str, set[str]] = {}
            for service, span in collector.spans:
                if span.trace_id.hex() == trace_id:
                    found.setdefault(service, set()).add(span.name)
            assert found == expected, found
            return found

        assert wait_for(ours, timeout=20) == expected
    finally:
        stop_process(gateway.process)
        stop_server(replica)
        server.stop(grace=None)


@pytest.mark.parametrize(
    ("environment", "expected"),
    [
        ({}, "pagefleet-gateway"),
        ({"OTEL_SERVICE_NAME": "edge-gateway"}, "edge-gateway"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=eu-gateway,deployment.environment=prod"}, "eu-gateway"),
    ],
)
def test_the_service_name_is_ours_unless_the_environment_names_one(
    environment: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagefleet.runtime.tracing import tracer_provider

    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    provider = tracer_provider("pagefleet-gateway", "http://127.0.0.1:4317")
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == expected
    finally:
        provider.shutdown()
