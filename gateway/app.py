"""The gateway's app, assembled: admission (keys, limits), routing, proxying, and the
fleet's own routes (models, health, metrics, dashboard, stored responses). The proxied
routes are plain ASGI in front of FastAPI (gateway/forwarding.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp

from pagefleet.gateway.admission import APIKeyGuard
from pagefleet.gateway.core import RoutingCore
from pagefleet.gateway.dashboard import PAGE, dashboard_data
from pagefleet.gateway.forwarding import ProxiedRoutes
from pagefleet.gateway.history import FleetHistory
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.paths import PROXIED_PATHS
from pagefleet.gateway.proxy import OutlierDetector
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.responses import stored_response_routes
from pagefleet.gateway.settings import GatewaySettings
from pagefleet.gateway.tracing import ProxyTracing
from pagefleet.gateway.upstream import UpstreamPool
from pagefleet.protocol.openai import ChatCompletionRequest, CompletionRequest
from pagefleet.protocol.responses import RESPONSES_PATH, ResponsesRequest
from pagefleet.runtime import tracing
from pagefleet.runtime.http import ErrorGuard, error_json
from pagefleet.runtime.tracing import ServerSpans


def create_app(settings: GatewaySettings, tracer_provider: TracerProvider | None = None) -> ASGIApp:
    """The gateway for `settings`; traces go to `tracer_provider`, else to
    `settings.otlp_traces_endpoint` if set."""
    metrics = GatewayMetrics()
    core = RoutingCore(settings, metrics)
    pool = UpstreamPool(settings.connect_timeout_s, settings.read_timeout_s)
    outliers = OutlierDetector(core.registry, settings.eject_after_failures, settings.exclude_failed_for_s)
    tracer_provider = tracer_provider or tracing.tracer_provider("pagefleet-gateway", settings.otlp_traces_endpoint)
    tracer = tracer_provider.get_tracer("pagefleet.gateway") if tracer_provider is not None else None
    proxy_tracing = ProxyTracing(tracer) if tracer is not None else None
    director = core.director(pool, outliers, settings.failover_attempts, proxy_tracing)
    history = FleetHistory(
        core.registry,
        metrics,
        settings.dashboard_interval_s,
        settings.dashboard_span_s,
        settings.dashboard_window_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await core.start()
        sampling = asyncio.create_task(history.run())
        yield
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        await history.close()
        pool.close()
        await core.close()
        if tracer_provider is not None:
            await asyncio.to_thread(tracer_provider.shutdown)  # the last spans go out

    app = FastAPI(title="pagefleet gateway", lifespan=lifespan)
    app.include_router(fleet_routes(core.registry, metrics, history))
    app.include_router(stored_response_routes(core.registry, core.admission, pool))
    _document_proxied_routes(app)
    proxied = ProxiedRoutes(app, director, metrics, settings.max_request_bytes)
    guarded = ErrorGuard(APIKeyGuard(proxied, core.admission))
    return ServerSpans(guarded, tracer, PROXIED_PATHS) if tracer is not None else guarded


def fleet_routes(registry: ReplicaRegistry, metrics: GatewayMetrics, history: FleetHistory) -> APIRouter:
    """The gateway's own routes: the models served, health, metrics and the dashboard."""
    routes = APIRouter()

    @routes.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "owned_by": "pagefleet",
                "replicas": len(registry.candidates(name)),
                **({"parent": parent} if (parent := registry.parent(name)) else {}),
            }
            for name in registry.models()
        ]
        return {"object": "list", "data": data}

    @routes.get("/health")
    async def health() -> Response:
        if not registry.is_available:
            return error_json(503, "The replica registry is unavailable (Redis unreachable).")
        return JSONResponse({"status": "ok", "models": registry.models()})

    @routes.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @routes.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(PAGE)

    @routes.get("/dashboard/data")
    async def dashboard_json() -> dict[str, Any]:
        return dashboard_data(registry, history)

    return routes


def _document_proxied_routes(app: FastAPI) -> None:
    """The proxied routes bypass FastAPI (see ProxiedRoutes); describe them in /openapi.json
    all the same, with the request schemas the replicas validate, for clients and fuzzers."""
    described = APIRouter()
    answers: dict[int | str, dict[str, Any]] = {
        status: {"description": text}
        for status, text in [
            (400, "invalid request"),
            (401, "missing API key"),
            (404, "unknown model"),
            (413, "body too large"),
            (429, "rate limited"),
            (503, "no replica can take it"),
        ]
    }

    # Declarations for the schema only: these routers are never mounted, so no request
    # reaches the functions (ProxiedRoutes serves both paths before FastAPI sees them).
    @described.post(
        "/v1/completions", responses=answers, response_model=dict[str, Any], summary="Completions, proxied to a replica"
    )
    def completions(body: CompletionRequest) -> None:
        """The request schema the replicas validate."""

    @described.post(
        "/v1/chat/completions",
        responses=answers,
        response_model=dict[str, Any],
        summary="Chat completions, proxied to a replica",
    )
    def chat_completions(body: ChatCompletionRequest) -> None:
        """The request schema the replicas validate."""

    @described.post(
        RESPONSES_PATH, responses=answers, response_model=dict[str, Any], summary="Responses, proxied to a replica"
    )
    def create_response(body: ResponsesRequest) -> None:
        """The request schema the replicas validate."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            routes = [*app.routes, *described.routes]
            app.openapi_schema = get_openapi(title=app.title, version=app.version, routes=routes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
