"""The Responses API's stored responses at the gateway. (`POST /v1/responses` itself is
proxied like chat: gateway/forwarding.py, its prompt built by shape.routed_payload.)

The stored-response routes (`GET`/`DELETE /v1/responses/{id}`, `.../cancel`,
  `.../input_items`) are relayed to a live replica: replicas read the same Redis, and the
one that answers passes a cancel on to the replica running the response.
"""

from __future__ import annotations

import logging
import os

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagefleet.gateway import errors
from pagefleet.gateway.admission import Admission
from pagefleet.gateway.errors import Refusal
from pagefleet.gateway.proxy import forwarded_headers
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.upstream import UpstreamError, UpstreamPool
from pagefleet.protocol.responses import RESPONSES_PATH

logger = logging.getLogger(__name__)


def stored_response_routes(registry: ReplicaRegistry, admission: Admission, pool: UpstreamPool) -> APIRouter:
    routes = APIRouter()

    async def relay(request: Request, method: bytes) -> Response:
        try:
            admission.authorize(request.headers.get("authorization", ""))
            return await _relay(registry, pool, request, method)
        except Refusal as refusal:
            return refusal.response()

    @routes.get(RESPONSES_PATH + "/{response_id}", summary="A stored response, from any replica")
    async def retrieve(response_id: str, request: Request) -> Response:
        return await relay(request, b"GET")

    @routes.delete(RESPONSES_PATH + "/{response_id}", summary="Delete a stored response")
    async def delete(response_id: str, request: Request) -> Response:
        return await relay(request, b"DELETE")

    @routes.post(RESPONSES_PATH + "/{response_id}/cancel", summary="Cancel a background response")
    async def cancel(response_id: str, request: Request) -> Response:
        return await relay(request, b"POST")

    @routes.get(RESPONSES_PATH + "/{response_id}/input_items", summary="A stored response's input items")
    async def input_items(response_id: str, request: Request) -> Response:
        return await relay(request, b"GET")

    return routes


async def _relay(registry: ReplicaRegistry, pool: UpstreamPool, request: Request, method: bytes) -> Response:
    """The request's answer from the first live replica that answers (any model's: they
    share the store); a Refusal (503) if none does."""
    raw_path, query = request.scope["raw_path"], request.scope["query_string"]  # as sent: percent-encoded
    try:
        path = (raw_path + (b"?" + query if query else b"")).decode("ascii")
    except UnicodeDecodeError:
        raise errors.bad_request("the request path must be percent-encoded ASCII") from None
    request_id = request.headers.get("x-request-id", "").encode() or b"req-" + os.urandom(16).hex().encode()
    headers = forwarded_headers(list(request.headers.raw), request_id)
    for model in registry.models():
        for replica in registry.candidates(model):
            try:
                answer = await pool.send(method, replica.url, path, b"", headers)
                body = await answer.read()
                answer.release()
            except (UpstreamError, TimeoutError) as error:
                logger.info("replica %s did not answer %s (%r); trying another", replica.replica_id, path, error)
                continue
            return Response(body, answer.status, media_type="application/json")
    raise errors.Refusal(503, "No replica is reachable to answer for stored responses.", "no_replica")
