"""`pagefleet picker`: an Endpoint Picker for Envoy-based gateways (the Gateway API
Inference Extension's protocol, over Envoy's external processing gRPC API).

Envoy streams each HTTP request's headers and body to the picker; the picker runs it
through the gateway's own director (gateway/director.py: admission, adapter, prefill, the
routing policies and Redis reservations), and answers with the header
`x-gateway-destination-endpoint: ip:port` and the same value under `envoy.lb` in the
dynamic metadata, so Envoy sends the request there itself: the picker never touches the
response's bytes. Refusals are Envoy immediate responses with the gateway's OpenAI error
bodies (404 unknown model, 429 rate limited, 503 no live replica). The reservation is
released when Envoy ends the exchange (the response is over).

Body modes: BUFFERED (Envoy sends the whole body, then waits) and FULL_DUPLEX_STREAMED (the
protocol's streaming mode: body chunks arrive without waiting; the picker answers the
headers once it has read the body, then gives the body back unchanged). Envoy says which
in the first message's `protocol_config`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorServicer
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct
from grpc import aio

from pagefleet.gateway import errors
from pagefleet.gateway.core import RoutingCore
from pagefleet.gateway.director import Director, Leg
from pagefleet.gateway.disaggregation import PREFILL_REPLICA_HEADER
from pagefleet.gateway.errors import Refusal
from pagefleet.gateway.proxy import forwarded_headers
from pagefleet.gateway.route import kv_peer_of
from pagefleet.gateway.routing import Route, by_load
from pagefleet.gateway.shape import SESSION_HEADER, RequestShape
from pagefleet.protocol.headers import KV_PEER_HEADER
from pagefleet.protocol.replica import ReplicaRecord

logger = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
REPLICA_HEADER = "x-pagefleet-replica"
_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED


def endpoint(url: str) -> str:
    """`ip:port` of a replica's URL (IPv6 in brackets), as Envoy takes it."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _header_value(header: HeaderValue) -> str:
    return header.raw_value.decode("latin-1") if header.raw_value else header.value


def _set_headers(values: dict[str, str]) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        set_headers=[
            HeaderValueOption(
                header=HeaderValue(key=name, raw_value=value.encode("latin-1")),
                append_action=HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
            )
            for name, value in values.items()
        ]
    )


def routed_headers(destination: str, route: Route | None, content_length: int | None) -> ext_proc.HeaderMutation:
    """What Envoy changes in the request it sends: the endpoints to try, the body's new
    length, and the peer to pull the prompt's prefix from when the route names one (as the
    gateway sends it: proxy.upstream_headers). A client's own peer header never reaches a
    replica: the peer is the router's to name."""
    headers = {DESTINATION: destination}
    if content_length is not None:
        headers["content-length"] = str(content_length)
    peer = kv_peer_of(route) if route is not None else None
    if peer is not None:
        headers[KV_PEER_HEADER] = peer
    mutation = _set_headers(headers)
    if peer is None:
        mutation.remove_headers.append(KV_PEER_HEADER)
    return mutation


def refusal_response(refusal: Refusal) -> ext_proc.ProcessingResponse:
    headers = {"content-type": "application/json", **{k.lower(): v for k, v in refusal.headers.items()}}
    immediate = ext_proc.ImmediateResponse(
        status=HttpStatus(code=refusal.status),  # type: ignore[arg-type]
        headers=_set_headers(headers),
        body=refusal.body(),
        details=refusal.reason,
    )
    return ext_proc.ProcessingResponse(immediate_response=immediate)


@dataclass
class Exchange:
    """One HTTP request as Envoy relays it to the picker."""

    duplex_request: bool = False  # FULL_DUPLEX_STREAMED request body
    duplex_response: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    body: list[bytes] = field(default_factory=list)
    shape: RequestShape | None = None
    route: Route | None = None
    endpoints: list[ReplicaRecord] = field(default_factory=list)  # chosen first, then fallbacks
    picked_at: float = 0.0
    picked: bool = False
    prefill_replica: str | None = None  # a disaggregated request's prompt ran there


class EndpointPicker(ExternalProcessorServicer):
    """The picker's front door: `director` (the gateway's, over `core`) runs each request
    up to its route, a disaggregated model's prompt on a prefill replica included; Envoy
    then sends the request (with what the prefill replica answered) where the route says,
    going down `fallbacks` more replicas if it must."""

    def __init__(self, core: RoutingCore, director: Director, fallbacks: int) -> None:
        self.core, self.director, self.fallbacks = core, director, fallbacks
        self.metrics = director.metrics
        self._releasing: set[asyncio.Task[None]] = set()

    async def Process(  # noqa: N802 (the gRPC method's name)
        self, requests: AsyncIterator[ext_proc.ProcessingRequest], context: aio.ServicerContext
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = Exchange()
        try:
            async for message in requests:
                for answer in await self._answer(message, exchange):
                    yield answer
        finally:
            if exchange.route is not None:  # the response is over (or Envoy gave up)
                # In a task of its own: Envoy's closing the stream may cancel this one.
                release = asyncio.ensure_future(exchange.route.release())
                self._releasing.add(release)
                release.add_done_callback(self._releasing.discard)

    async def _answer(
        self, message: ext_proc.ProcessingRequest, exchange: Exchange
    ) -> list[ext_proc.ProcessingResponse]:
        if message.HasField("protocol_config"):
            exchange.duplex_request = message.protocol_config.request_body_mode == _DUPLEX
            exchange.duplex_response = message.protocol_config.response_body_mode == _DUPLEX
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            exchange.headers = {h.key.lower(): _header_value(h) for h in message.request_headers.headers.headers}
            if message.request_headers.end_of_stream:  # no body (GET /v1/models, /health)
                return await self._pick(exchange, message)
            if exchange.duplex_request:
                return []  # answered once the body is in
            return [ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())]
        if kind == "request_body":
            exchange.body.append(message.request_body.body)
            if message.request_body.end_of_stream:
                return await self._pick(exchange, message)
            if exchange.duplex_request:
                return []
            return [ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())]
        if kind == "request_trailers":
            answers = [] if exchange.picked else await self._pick(exchange, message)
            return [*answers, ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())]
        if kind == "response_headers":
            served = self._served(exchange, message)
            if served is None:
                return [ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())]
            # As through the gateway: the client sees which replica answered.
            said = {REPLICA_HEADER: served.replica_id}
            if exchange.prefill_replica is not None:
                said[PREFILL_REPLICA_HEADER] = exchange.prefill_replica
            common = ext_proc.CommonResponse(header_mutation=_set_headers(said))
            return [ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse(response=common))]
        if kind == "response_body":
            if not exchange.duplex_response:
                return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())]
            chunk = message.response_body
            echo = ext_proc.StreamedBodyResponse(body=chunk.body, end_of_stream=chunk.end_of_stream)
            common = ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(streamed_response=echo))
            return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse(response=common))]
        return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]

    async def _pick(self, exchange: Exchange, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        """Admit and route the request; the answers that send it to its replica, or refuse it."""
        exchange.picked = True
        body = b"".join(exchange.body)
        sent_body = body
        try:
            authorization = exchange.headers.get("authorization", "")
            if not body:
                self.director.authorize(authorization)
                exchange.endpoints = self._any_replica(self._subset(message))
            else:
                path = exchange.headers.get(":path", "").split("?", 1)[0]
                shape = await self.director.admit(path, authorization, body, exchange.headers.get(SESSION_HEADER))
                exchange.shape = shape
                request_id = exchange.headers.get("x-request-id") or uuid.uuid4().hex
                headers = self._forwarded(exchange, request_id)
                leg = await self.director.prepare(path, body, headers, shape, request_id.encode())
                exchange.route, leg = await self._route(shape, self._subset(message), leg, body)
                exchange.prefill_replica, sent_body = leg.prefill_replica, leg.body
                exchange.endpoints = [exchange.route.replica, *exchange.route.fallbacks[: self.fallbacks]]
        except Refusal as refusal:  # admission and routing have counted it already
            return [refusal_response(refusal)]
        exchange.picked_at = time.monotonic()
        destination = ",".join(endpoint(record.url) for record in exchange.endpoints)
        length = len(sent_body) if sent_body is not body else None  # the decode request's body grew
        mutation = routed_headers(destination, exchange.route, length)
        common = ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=True)  # routes may match on it
        lb = Struct()
        lb.update({LB_NAMESPACE: {DESTINATION: destination}})
        if not body:
            return [
                ext_proc.ProcessingResponse(
                    request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=lb
                )
            ]
        if not exchange.duplex_request:
            if sent_body is not body:
                common.body_mutation.CopyFrom(ext_proc.BodyMutation(body=sent_body))
            return [
                ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=lb)
            ]
        echo = ext_proc.StreamedBodyResponse(body=sent_body, end_of_stream=True)
        whole_body = ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(streamed_response=echo))
        return [
            ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=lb),
            ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=whole_body)),
        ]

    @staticmethod
    def _forwarded(exchange: Exchange, request_id: str = "") -> bytes:
        """The client's headers as header lines for a call the picker makes itself."""
        request_id = request_id or exchange.headers.get("x-request-id") or uuid.uuid4().hex
        pairs = [(k.encode(), v.encode("latin-1")) for k, v in exchange.headers.items() if not k.startswith(":")]
        return forwarded_headers(pairs, request_id.encode())

    async def _route(self, shape: RequestShape, subset: set[str] | None, leg: Leg, body: bytes) -> tuple[Route, Leg]:
        """The route for `leg` among the endpoints Envoy allows, and the leg it carries: a
        decode request that finds no decode replica runs whole, as the client sent it (its
        prompt's KV waits in vain: its pin times out)."""
        outside = set()
        if subset is not None:
            outside = {r.url for r in self.core.registry.candidates(shape.model) if endpoint(r.url) not in subset}
        route = await self.director.route(shape, outside, leg.phase)
        if leg.phase == "decode":
            if route is not None:
                self.director.paired(shape)
            else:
                leg = self.director.without_prefill(shape, body)
                route = await self.director.route(shape, outside, leg.phase)
        if route is None:
            raise self.metrics.refused(errors.no_replica(shape.model))
        return route, leg

    def _any_replica(self, subset: set[str] | None) -> list[ReplicaRecord]:
        """For a request without a body (no model named): the emptiest live replica."""
        if not self.core.registry.is_available:
            raise self.metrics.refused(errors.registry_unavailable())
        records = [r for records in self.core.registry.by_model.values() for r in records]
        records = [r for r in records if subset is None or endpoint(r.url) in subset]
        if not records:
            raise self.metrics.refused(errors.no_replica("any model"))
        return by_load(records)[:1]

    @staticmethod
    def _subset(message: ext_proc.ProcessingRequest) -> set[str] | None:
        """The endpoints the proxy allows (`envoy.lb.subset_hint`), if it says."""
        hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if hint is None or SUBSET not in hint.fields:
            return None
        return {value.string_value for value in hint.fields[SUBSET].list_value.values}

    def _served(self, exchange: Exchange, message: ext_proc.ProcessingRequest) -> ReplicaRecord | None:
        """The replica that served the response, counted under it (the proxy may have gone
        down the fallbacks: it says which in `envoy.lb`)."""
        if not exchange.endpoints:
            return None
        served = exchange.endpoints[0]
        lb = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
        if lb is not None and SERVED in lb.fields:
            address = lb.fields[SERVED].string_value
            served = next((r for r in exchange.endpoints if endpoint(r.url) == address), served)
        status = next((_header_value(h) for h in message.response_headers.headers.headers if h.key == ":status"), "")
        model = exchange.shape.model if exchange.shape is not None else served.model
        self.director.record(model, served, status, time.monotonic() - exchange.picked_at)
        return served
