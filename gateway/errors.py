"""Why the routing layer refuses a request, one shape for the gateway and the picker: an
OpenAI error body with its status, extra headers (Retry-After) and the reason it is counted
under in `pagefleet_gateway:errors` (with the model's label only once the model is known
to exist: a made-up name must not make a label of its own)."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from pagefleet.protocol.openai import error_response
from pagefleet.runtime.http import error_json


class Refusal(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        reason: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        model: str = "",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.reason, self.param = status, message, reason, param
        self.headers, self.model = headers or {}, model

    def body(self) -> bytes:
        return json.dumps(error_response(self.status, self.message, self.param)).encode()

    def response(self) -> JSONResponse:
        return error_json(self.status, self.message, self.param, self.headers)


def unauthorized() -> Refusal:
    return Refusal(401, "A valid API key is required (Authorization: Bearer <key>).", "unauthorized")


def too_large(limit: int) -> Refusal:
    return Refusal(413, f"The request body exceeds {limit} bytes.", "too_large")


def bad_request(message: str, param: str | None = None) -> Refusal:
    return Refusal(400, message, "bad_request", param)


def registry_unavailable() -> Refusal:
    message = "The replica registry is unavailable (Redis unreachable); retry shortly."
    return Refusal(503, message, "registry_unavailable", headers={"Retry-After": "5"})


def unknown_model(model: str, served: list[str]) -> Refusal:
    message = f"The model `{model}` does not exist. Served models: {', '.join(served) or 'none'}."
    return Refusal(404, message, "unknown_model", "model")


def rate_limited(model: str, reason: str, retry_after: int) -> Refusal:
    retry = {"Retry-After": str(retry_after)}
    return Refusal(429, f"Rate limit exceeded: {reason}.", "rate_limited", headers=retry, model=model)


def no_replica(model: str) -> Refusal:
    message = f"No replica of `{model}` could take the request; retry shortly."
    return Refusal(503, message, "no_replica", headers={"Retry-After": "1"}, model=model)


def hold_full(model: str, limit: int) -> Refusal:
    message = f"`{model}` is starting from zero replicas and {limit} requests already wait for it; retry shortly."
    return Refusal(503, message, "hold_full", headers={"Retry-After": "5"}, model=model)


def not_started(model: str, seconds: float) -> Refusal:
    message = f"No replica of `{model}` started within {seconds:g} s of asking for one; retry shortly."
    return Refusal(503, message, "not_started", headers={"Retry-After": "10"}, model=model)
