"""An OTLP/gRPC trace receiver that only counts spans, for benchmarks that turn tracing on:
the exporter does its real work (batching, protobuf, gRPC) without a collector's costs.

    python bench/otlp_sink.py PORT      # prints "spans N" after each batch
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import (
    TraceServiceServicer,
    add_TraceServiceServicer_to_server,
)


class CountingSink(TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    def Export(self, request: Any, context: Any) -> ExportTraceServiceResponse:  # noqa: N802 - the gRPC method's name
        self.spans += sum(len(scope.spans) for spans in request.resource_spans for scope in spans.scope_spans)
        print(f"spans {self.spans}", flush=True)
        return ExportTraceServiceResponse()


def main() -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    add_TraceServiceServicer_to_server(CountingSink(), server)
    server.add_insecure_port(f"127.0.0.1:{int(sys.argv[1])}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
