"""The FastAPI app of one engine replica, assembled: its state, its lifespan (loading, Redis,
leaving when the engine dies: lifecycle.py), its middleware (errors in each API's shape,
the body limit, API keys, traces) and its routes. Every error is JSON in its API's shape
(errors.py).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider

from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.server.auth import APIKeyGuard
from pagefleet.engine.server.errors import install_error_handlers
from pagefleet.engine.server.kv_peers import PeerHint, add_peer_routes
from pagefleet.engine.server.kv_transfer import KVTransfers, add_kv_routes
from pagefleet.engine.server.lifecycle import EXIT_ENGINE_DEAD, EXIT_LOAD_FAILED, ReplicaLifecycle
from pagefleet.engine.server.lora import Adapters, add_lora_routes
from pagefleet.engine.server.messages import add_messages_routes
from pagefleet.engine.server.metrics import ServerMetrics
from pagefleet.engine.server.middleware import BodySizeLimit, InFlight
from pagefleet.engine.server.responses import add_responses_routes
from pagefleet.engine.server.routes import add_core_routes, server_version
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.engine.server.state import ServerState
from pagefleet.engine.server.stored_responses import StoredResponses
from pagefleet.engine.server.tokenizer_info import add_tokenizer_route
from pagefleet.engine.server.tracing import RequestTracing
from pagefleet.protocol.anthropic import MESSAGES_PATH
from pagefleet.protocol.responses import RESPONSES_PATH
from pagefleet.runtime import tracing
from pagefleet.runtime.http import ErrorGuard
from pagefleet.runtime.response_store import MemoryResponseStore, RedisResponseStore
from pagefleet.runtime.tracing import ServerSpans

__all__ = ["EXIT_ENGINE_DEAD", "EXIT_LOAD_FAILED", "create_app"]

TRACED_PATHS = ("/v1/completions", "/v1/chat/completions", RESPONSES_PATH, MESSAGES_PATH)


def _stored_responses(settings: ServerSettings) -> StoredResponses:
    """Stored responses in Redis where the fleet's replicas and gateways can all read them;
    in this process when the server has no Redis."""
    ttl = settings.response_store_ttl
    store = RedisResponseStore.from_url(settings.redis_url, ttl) if settings.redis_url else MemoryResponseStore(ttl)
    return StoredResponses(store, settings.url)


def _stats(state: ServerState) -> EngineStats | None:
    """The engine's stats, counted from the end of the warm-up (lifecycle.py)."""
    if state.engine is None:
        return None
    stats = state.engine.stats()
    return stats.since(state.warm_up_stats) if state.warm_up_stats is not None else stats


def create_app(
    settings: ServerSettings,
    engine: AsyncEngine | None = None,
    stop_server: Callable[[], None] | None = None,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """The app for `settings`; pass an `engine` to serve one built already (tests).

    `stop_server` makes the HTTP server stop gracefully; it is called if the engine dies
    (the server's runner then exits with `state.exit_code`). Traces go to
    `tracer_provider`, else to `settings.otlp_traces_endpoint` if set.
    """
    state: ServerState
    metrics = ServerMetrics(settings.model_name, lambda: _stats(state))
    state = ServerState(
        settings, metrics, KVTransfers(settings, metrics), Adapters(settings.model_name), _stored_responses(settings)
    )
    tracer_provider = tracer_provider or tracing.tracer_provider("pagefleet-engine", settings.otlp_traces_endpoint)
    tracer = tracer_provider.get_tracer("pagefleet.engine") if tracer_provider is not None else None
    if tracer is not None:
        state.tracing = RequestTracing(tracer)

    lifecycle = ReplicaLifecycle(state, engine, stop_server, tracer_provider)
    app = FastAPI(
        title="pagefleet engine", version=server_version(), lifespan=lifecycle.lifespan, root_path=settings.root_path
    )
    app.state.server = state
    app.state.lifecycle = lifecycle  # its `drain_soon` is what SIGTERM does (cli/serve.py)
    install_error_handlers(app)
    app.add_middleware(ErrorGuard)
    app.add_middleware(BodySizeLimit, limit=settings.max_request_bytes)
    app.add_middleware(InFlight, state=state)
    app.add_middleware(PeerHint)
    if settings.api_key:
        app.add_middleware(APIKeyGuard, keys=settings.api_key)
    add_core_routes(app, state)
    add_kv_routes(app, state.transfers, lambda: state.ready_engine(None))
    add_peer_routes(app, state.transfers, lambda: state.ready_engine(None))
    add_lora_routes(app, state.adapters, lambda: state.ready_engine(None))
    if settings.enable_tokenizer_info_endpoint:
        add_tokenizer_route(app, settings.model_name, lambda: state.ready_engine(None))
    add_messages_routes(app, state)
    add_responses_routes(app, state)
    if tracer is not None:
        app.add_middleware(ServerSpans, tracer=tracer, paths=TRACED_PATHS)
    return app
