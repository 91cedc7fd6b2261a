"""Running `pagefleet picker`: the ext_proc service and gRPC health checks on one port,
Prometheus metrics over HTTP on another, until SIGTERM.

Health (the gRPC Health Checking Protocol, as the inference extension asks): `liveness`
serves while the process runs; `readiness`, the ext_proc service's own name and "" serve
while the registry has a view of the replicas (Redis reachable within its grace period).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from envoy.service.ext_proc.v3.external_processor_pb2_grpc import add_ExternalProcessorServicer_to_server
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pagefleet.gateway.core import RoutingCore
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.picker import EndpointPicker
from pagefleet.gateway.proxy import OutlierDetector
from pagefleet.gateway.settings import PickerSettings
from pagefleet.gateway.upstream import UpstreamPool
from pagefleet.runtime.metrics_http import serve_metrics

logger = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
_HEALTH_EVERY_S = 1.0


async def serve(settings: PickerSettings, started: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM or SIGINT (or cancellation); `started` is set once listening."""
    metrics = GatewayMetrics("pagefleet_picker")
    core = RoutingCore(settings, metrics)
    await core.start()
    server = aio.server()
    # Disaggregated models' prompts go to their prefill replicas, and unserved adapters are
    # loaded, from here (gateway/director.py).
    outliers = OutlierDetector(core.registry, threshold=3, exclude_for=10.0)
    pool = UpstreamPool(2.0, settings.prefill_timeout_s)
    director = core.director(pool, outliers, settings.prefill_attempts)
    add_ExternalProcessorServicer_to_server(EndpointPicker(core, director, settings.fallbacks), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"{settings.host}:{settings.port}")
    metrics_server = (
        serve_metrics(metrics.registry, settings.metrics_port, settings.host) if settings.metrics_port else None
    )
    await server.start()
    logger.info("picker listening on %s:%d", settings.host, settings.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if started is not None:
        started.set()
    reporting = asyncio.create_task(_report_health(health, core))
    try:
        await stop.wait()
    finally:
        reporting.cancel()
        await health.enter_graceful_shutdown()
        await server.stop(grace=5)
        pool.close()
        await core.close()
        if metrics_server is not None:
            metrics_server.close()


async def _report_health(health: health_aio.HealthServicer, core: RoutingCore) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await health.set("liveness", serving)
    while True:
        ready = serving if core.registry.is_available else not_serving
        for service in READY_SERVICES:
            await health.set(service, ready)
        await asyncio.sleep(_HEALTH_EVERY_S)
