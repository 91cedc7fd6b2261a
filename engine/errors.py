"""Errors the engine raises to its callers.

Invalid input is a `ValueError` (so plain Python callers can catch it as usual); the
subclasses let the HTTP layer map each case to the right OpenAI-style status code.
"""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidParameterError(ValueError, EngineError):
    """A request parameter is invalid. `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.detail = param, message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses to the caller's process whole
        return type(self), (self.param, self.detail)


class PromptTooLongError(InvalidParameterError):
    """The prompt (plus the tokens asked for) does not fit the context window or the cache."""


class AdapterNotFoundError(InvalidParameterError):
    """A LoRA adapter's path holds no adapter (HTTP 404, as vLLM answers it)."""


class UnsupportedModelError(ValueError, EngineError):
    """The model's architecture, format or settings are not supported."""


class ModelNotFoundError(FileNotFoundError, EngineError):
    """A model name or path did not resolve to weights on this machine."""


class EngineDeadError(RuntimeError, EngineError):
    """The engine loop stopped after an unexpected error; no more requests can run."""


class RequestFailedError(RuntimeError, EngineError):
    """One request failed inside the engine step (its own sampling, beam scoring, stop
    checks or detokenizing); its blocks are freed and every other request runs on."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id, self.detail = request_id, message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.request_id, self.detail)


class ShuttingDownError(RuntimeError, EngineError):
    """The server is shutting down and this request did not finish within its drain time."""
