"""The server's state: settings, metrics and the engine once it is loaded and warm."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.engine.server.kv_transfer import KVTransfers
from pagefleet.engine.server.lora import Adapters
from pagefleet.engine.server.metrics import ServerMetrics
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.engine.server.stored_responses import StoredResponses
from pagefleet.engine.server.tracing import RequestTracing


@dataclass(slots=True)
class ServerState:
    settings: ServerSettings
    metrics: ServerMetrics
    transfers: KVTransfers
    adapters: Adapters
    responses: StoredResponses  # the Responses API's stored responses
    engine: AsyncEngine | None = None  # None until the model is loaded and warm
    warm_up_stats: EngineStats | None = None  # the engine's stats after the warm-up, which clients never see
    tracing: RequestTracing | None = None  # None unless traces are exported
    load_error: BaseException | None = None
    exit_code: int = 0  # what the process exits with once the server stops (non-zero: the engine died)
    draining: bool = False  # SIGTERM came: new requests get 503, those in flight finish (lifecycle.py)
    num_in_flight: int = 0  # API requests not answered to their last byte yet (middleware.InFlight)
    server_load: int = 0  # of those, the generating ones, with --enable-server-load-tracking (middleware.InFlight)
    created: int = field(default_factory=lambda: int(time.time()))

    def ready_engine(self, model: str | None) -> AsyncEngine:
        """The engine, once `model` (the base model or one of its adapters) is known to be
        ours; the right error otherwise."""
        if model is not None and model != self.settings.model_name and model not in self.adapters.by_name:
            served = ", ".join(f"`{name}`" for name in [self.settings.model_name, *sorted(self.adapters.by_name)])
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves {served}.", "model")
        if self.engine is None:
            raise OpenAIError(503, "The model is still loading; retry shortly.", headers={"Retry-After": "5"})
        return self.engine

    def served_name(self, model: str | None) -> str:
        """The name an answer carries: the adapter's when one was asked for."""
        return model if model is not None and model in self.adapters.by_name else self.settings.model_name

    def admit(self, engine: AsyncEngine) -> None:
        """Refuse a new request (503) while the server drains or too many already wait."""
        if self.draining:
            raise OpenAIError(
                503, "The server is shutting down; retry on another replica.", headers={"Retry-After": "1"}
            )
        limit = self.settings.max_waiting_requests
        if engine.stats().num_waiting_requests >= limit:
            raise OpenAIError(
                503, f"The server is at capacity ({limit} requests waiting); retry later.", headers={"Retry-After": "1"}
            )


def tokenizer_of(engine: AsyncEngine) -> Any:
    """The engine's tokenizer; a 400 on a replica started with --skip-tokenizer-init, which
    takes token ids and answers token ids only."""
    if engine.tokenizer is None:
        raise OpenAIError(
            400, "this server runs without a tokenizer (--skip-tokenizer-init): send and read token ids", "prompt"
        )
    return engine.tokenizer
