"""Every error the replica answers is JSON in its API's shape, whatever raised it: OpenAI's
(`{"error": {...}}`), or Anthropic's (`{"type": "error", "error": {...}}`) on its
Messages routes (`error_for`).

Known errors map to their status: invalid input (pydantic, `InvalidParameterError`) is 400
naming the field, a request that failed inside the engine is 500, a stopped engine is 503.
Anything else is caught by `runtime.http.ErrorGuard` at the edge of the app.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagefleet.engine.errors import EngineDeadError, InvalidParameterError, RequestFailedError, ShuttingDownError
from pagefleet.protocol.anthropic import MESSAGES_PATH
from pagefleet.protocol.anthropic import error_body as anthropic_error
from pagefleet.runtime.http import error_json

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """Answered as `{"error": {...}}` with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_for(
    path: str, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The error answer of a request to `path`, in that API's shape."""
    if path.startswith(MESSAGES_PATH):
        return JSONResponse(anthropic_error(status, message), status_code=status, headers=headers)
    return error_json(status, message, param, headers)


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) of the first pydantic error (a mapping with `loc` and `msg`), the
    field path as OpenAI names it."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    kind = first.get("type")  # pydantic's name of the rule (greater_than_equal, ...), as vLLM's messages carry it
    message = str(first.get("msg")) + (f" [type={kind}]" if kind and kind != "value_error" else "")
    return (f"{param}: {message}" if param else message), param


def status_of(error: BaseException) -> tuple[int, str]:
    """The status and message a client gets for `error` (also inside an event stream)."""
    if isinstance(error, OpenAIError):
        return error.status, error.message
    if isinstance(error, InvalidParameterError):
        return 400, str(error)
    if isinstance(error, EngineDeadError):
        return 503, f"The engine stopped: {error}"
    if isinstance(error, ShuttingDownError):
        return 503, str(error)
    if isinstance(error, RequestFailedError):
        return 500, f"The request failed inside the engine: {error}"
    return 500, "Internal server error."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return error_for(request.url.path, error.status, error.message, error.param, error.headers)

    @app.exception_handler(InvalidParameterError)
    async def invalid_parameter(request: Request, error: InvalidParameterError) -> JSONResponse:
        return error_for(request.url.path, 400, str(error), error.param)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_for(request.url.path, 400, *_validation_message(error.errors()))

    @app.exception_handler(ValidationError)
    async def validation_error(request: Request, error: ValidationError) -> JSONResponse:
        # A model built inside a handler from request data: still the client's input.
        return error_for(request.url.path, 400, *_validation_message(error.errors()))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return error_for(request.url.path, *status_of(error))

    @app.exception_handler(RequestFailedError)
    async def request_failed(request: Request, error: RequestFailedError) -> JSONResponse:
        return error_for(request.url.path, *status_of(error))

    @app.exception_handler(ShuttingDownError)
    async def shutting_down(request: Request, error: ShuttingDownError) -> JSONResponse:
        return error_for(request.url.path, *status_of(error))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_for(request.url.path, error.status_code, str(error.detail))
