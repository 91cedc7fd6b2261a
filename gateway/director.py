"""One request's way through the fleet, the same whichever front door it came in by.

Both front doors, the gateway's proxied routes (forwarding.py) and the Envoy picker
(picker.py), run each request through one `Director`, in this order:

1. authorize and shape (`admit`): the API key, the body's model and prompt, rate limits,
   the conversation a Responses or Messages request continues, the session;
2. adapter (`prepare`): a LoRA adapter no live replica serves is loaded first on the best
   replica of its base model;
3. prefill (`prepare`): a disaggregated model's prompt runs on a prefill replica (the
   director calls it itself, failing over); the request then becomes a decode request that
   says where its prompt's KV waits;
4. decide (`route`): the model's policy picks the replica, the fallbacks, and the peer the
   replica may pull the prompt's prefix from (`upstream_headers`, `routed_headers`);
5. decode or whole, with fallback: the two doors differ only here. The gateway sends the
   request itself and fails over before the first byte (`forward`); the picker hands the
   route to Envoy, which sends it and goes down the fallbacks. A decode request that finds
   no decode replica runs whole, as the client sent it (`without_prefill`);
6. record: every answer counted under its replica (`record`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span

from pagefleet.gateway import errors
from pagefleet.gateway.admission import Admission
from pagefleet.gateway.disaggregation import (
    PREFILL_REPLICA_HEADER,
    Prefilled,
    decode_body,
    prefill_body,
    transfer_params,
)
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.paths import CHAT_COMPLETIONS, CHAT_PATHS, DISAGGREGATED_PATHS
from pagefleet.gateway.proxy import OutlierDetector, Relay, upstream_headers
from pagefleet.gateway.routing import Route, Router
from pagefleet.gateway.shape import RequestShape, routed_payload
from pagefleet.gateway.tracing import ProxyTracing
from pagefleet.gateway.upstream import UpstreamError, UpstreamPool
from pagefleet.protocol.replica import ReplicaRecord
from pagefleet.runtime.response_store import ResponseStore

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Leg:
    """The request a front door sends once the prefill, if any, is done."""

    body: bytes
    phase: str  # "whole", "decode" (after a prefill) or "prefill"
    prefill_replica: str | None = None  # where a decode request's prompt ran

    @property
    def answer_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """What the client is told besides the answering replica."""
        if self.prefill_replica is None:
            return ()
        return ((PREFILL_REPLICA_HEADER.encode(), self.prefill_replica.encode()),)


class Director:
    """The request sequence of the module docstring, for both front doors. `attempts`: how
    many replicas a call tries before giving up (the prefill's, and the gateway's own)."""

    def __init__(
        self,
        admission: Admission,
        router: Router,
        responses: ResponseStore,
        pool: UpstreamPool,
        outliers: OutlierDetector,
        metrics: GatewayMetrics,
        attempts: int,
        tracing: ProxyTracing | None = None,
    ) -> None:
        self.admission, self.router, self.responses = admission, router, responses
        self.pool, self.outliers, self.metrics = pool, outliers, metrics
        self.attempts, self.tracing = attempts, tracing

    # --- 1. authorize and shape ---------------------------------------------------------------

    def authorize(self, authorization: str) -> None:
        """A request without a body (no model named): only its key is checked."""
        self.admission.authorize(authorization)

    async def admit(self, path: str, authorization: str, body: bytes, session: str | None) -> RequestShape:
        """The request's shape if it may be routed; raises the Refusal to answer otherwise."""
        shape = await self.admission.admit(authorization, body, chat=path in CHAT_PATHS)
        if path != CHAT_COMPLETIONS and path in CHAT_PATHS:
            shape.payload = await routed_payload(path, shape.payload, self.responses)
        if session:
            shape.session = session
        return shape

    # --- 2-3. adapter and prefill -------------------------------------------------------------

    async def prepare(self, path: str, body: bytes, headers: bytes, shape: RequestShape, request_id: bytes) -> Leg:
        """The adapter loaded if it must be, the prompt prefilled if the model is served
        disaggregated: the request to route next. A prefill that no replica could run
        leaves the request whole (one replica then runs it all)."""
        await self.ensure_adapter(shape, headers)
        if not (self.router.is_disaggregated(shape.model) and path in DISAGGREGATED_PATHS):
            return Leg(body, "whole")
        payload = json.loads(body)
        prefilled = await self.prefill(path, payload, headers, shape, request_id)
        if prefilled is None:
            return self.without_prefill(shape, body)
        return Leg(decode_body(payload, prefilled.transfer), "decode", prefilled.replica_id)

    def without_prefill(self, shape: RequestShape, body: bytes) -> Leg:
        """The request as the client sent it, for one replica to run whole: its prefill or
        its decode found no replica."""
        self.metrics.disaggregated.labels(shape.model, "fallback").inc()
        return Leg(body, "whole")

    def paired(self, shape: RequestShape) -> None:
        """A decode request reached a decode replica."""
        self.metrics.disaggregated.labels(shape.model, "paired").inc()

    async def prefill(
        self, path: str, payload: dict[str, Any], headers: bytes, shape: RequestShape, request_id: bytes
    ) -> Prefilled | None:
        """Run the prompt on a prefill replica (failing over like any call); None when none did."""
        relay = await self.call(path, Leg(prefill_body(payload), "prefill"), headers, shape, request_id)
        if relay is None:
            return None
        answer = await relay.upstream.read()
        relay.upstream.release()
        if relay.span is not None:
            relay.span.end()
        transfer = transfer_params(answer) if relay.upstream.status == 200 else None
        if transfer is None:  # its own error (the request's): the whole request says it again
            return None
        return Prefilled(transfer, dict(relay.headers).get(b"x-pagefleet-replica", b"").decode())

    async def ensure_adapter(self, shape: RequestShape, headers: bytes) -> None:
        """If `shape.model` is a LoRA adapter that the catalog knows but no live replica
        serves, load it on the replica of its base model that the policy picks; a failure
        is logged (the request then finds no replica)."""
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

    # --- 4. decide ----------------------------------------------------------------------------

    async def route(self, shape: RequestShape, tried: set[str], phase: str) -> Route | None:
        """The replica for `phase` among those not in `tried`, or None if none is left."""
        if self.tracing is None:
            return await self.router.pick(shape, tried, phase)
        with self.tracing.routing(shape.model, phase) as span:
            route = await self.router.pick(shape, tried, phase)
            span.chosen(route)
            return route

    # --- 5. the gateway's execution: send it, fail over ---------------------------------------

    async def forward(self, path: str, body: bytes, headers: bytes, shape: RequestShape, request_id: bytes) -> Relay:
        """The first replica's answer that is not a failure of its own; raises a Refusal
        (503) when no replica of the model could take the request."""
        leg = await self.prepare(path, body, headers, shape, request_id)
        relay = await self.call(path, leg, headers, shape, request_id)
        if leg.phase == "decode":
            if relay is not None:
                self.paired(shape)
            else:
                relay = await self.call(path, self.without_prefill(shape, body), headers, shape, request_id)
        if relay is None:
            raise self.metrics.refused(errors.no_replica(shape.model))
        return relay

    async def call(self, path: str, leg: Leg, headers: bytes, shape: RequestShape, request_id: bytes) -> Relay | None:
        """The first answer of a replica of `leg.phase` that is not a failure of its own, or
        None. A decode replica's 502 (its KV pull failed) is None at once."""
        tried: set[str] = set()
        for _ in range(self.attempts):
            route = await self.route(shape, tried, leg.phase)
            if route is None:
                return None
            replica = route.replica
            tried.add(replica.url)
            started = time.monotonic()
            span, trace_lines = self.tracing.call(path, replica, leg.phase) if self.tracing is not None else (None, b"")
            try:
                upstream = await self.pool.post(
                    replica.url, path, leg.body, upstream_headers(headers, route, trace_lines)
                )
            except (UpstreamError, TimeoutError) as exc:
                await self.failed(route, str(exc) or repr(exc), span)
                continue
            if leg.phase == "decode" and upstream.status == 502:
                # Its KV pull failed: the prefill replica's fault, not this one's. Another
                # decode replica would pull from the same place, so the request runs whole.
                upstream.close()
                await self.pull_failed(route, leg, span)
                return None
            # 503: the replica cannot take it now (full, loading, stopped).
            if upstream.status == 503:
                upstream.close()
                await self.failed(route, f"HTTP {upstream.status}", span)
                continue
            self.outliers.succeeded(replica.url)
            self.record(shape.model, replica, upstream.status, time.monotonic() - started)
            if span is not None:
                ProxyTracing.answered(span, upstream.status)
            said = [(b"x-request-id", request_id), (b"x-pagefleet-replica", replica.replica_id.encode())]
            counter = self.metrics.cached_prompt_tokens.labels(shape.model, replica.replica_id)
            return Relay(upstream, request_id.decode("latin-1"), [*said, *leg.answer_headers], span, counter.inc)
        return None

    async def failed(self, route: Route, reason: str, span: Span | None = None) -> None:
        """The replica failed before the first byte: its promise dropped, its failure counted."""
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

    async def pull_failed(self, route: Route, leg: Leg, span: Span | None) -> None:
        """A decode replica could not pull the prompt's KV from `leg.prefill_replica`: its
        promise dropped, and it is not counted as failing (it answered; the request is
        then routed whole, to any replica)."""
        if span is not None:
            ProxyTracing.failed(span, "HTTP 502 (KV pull)")
        await route.release()
        logger.warning(
            "replica %s could not pull the prompt's KV from %s; running the request whole",
            route.replica.replica_id,
            leg.prefill_replica,
        )

    # --- 6. record ----------------------------------------------------------------------------

    def record(self, model: str, replica: ReplicaRecord, status: int | str, seconds: float) -> None:
        """An answer of `replica` (its status), `seconds` after the request was sent to it."""
        self.metrics.upstream_latency.labels(model, replica.replica_id).observe(seconds)
        self.metrics.requests.labels(model, replica.replica_id, str(status)).inc()
