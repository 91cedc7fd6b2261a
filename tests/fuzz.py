"""Property-based fuzzing of an HTTP API from its OpenAPI description (schemathesis).

Every operation gets a bounded number of generated requests, both valid ones (positive) and
ones that break the schema (negative), from a fixed seed so that a run is reproducible. The
property: no input gives a 5xx, and every error is a JSON body in its API's shape (OpenAI's;
Anthropic's on its Messages routes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import schemathesis
from hypothesis import HealthCheck, given, seed, settings

SEED = 20261123


@dataclass
class FuzzReport:
    num_requests: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def _is_api_error(content: bytes, path: str) -> bool:
    try:
        body = json.loads(content)
        error = body["error"]
    except (ValueError, KeyError, TypeError):
        return False
    if path.startswith("/v1/messages"):  # Anthropic's shape
        return body.get("type") == "error" and isinstance(error, dict) and {"message", "type"} <= error.keys()
    return isinstance(error, dict) and {"message", "type", "code"} <= error.keys()


LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
CHEAP_LENGTH = 8


def naming_model(name: str) -> Callable[[schemathesis.Case], None]:
    """A `prepare` that sends generated bodies to the served model, so that most of them
    reach the engine instead of stopping at "unknown model", and keeps valid output
    lengths short (a generated 500-token answer tests nothing an 8-token one does not, and
    a chat body without a length runs to the end of the context; lengths out of bounds
    stay as generated, to be refused)."""

    def prepare(case: schemathesis.Case) -> None:
        if not isinstance(case.body, dict):
            return
        if "model" in case.body:
            case.body["model"] = name
        for length in LENGTH_FIELDS:
            value = case.body.get(length)
            if isinstance(value, int) and not isinstance(value, bool) and CHEAP_LENGTH < value <= 1 << 16:
                case.body[length] = CHEAP_LENGTH
        chat_like = "messages" in case.body or "input" in case.body  # no length: the whole context
        if chat_like and not any(length in case.body for length in LENGTH_FIELDS):
            case.body["max_output_tokens" if "input" in case.body else "max_tokens"] = CHEAP_LENGTH

    return prepare


def fuzz_api(
    base_url: str,
    examples_per_operation: int,
    prepare: Callable[[schemathesis.Case], None] = lambda case: None,
) -> FuzzReport:
    """Fuzz every operation of `base_url`/openapi.json; `prepare` may adjust each case."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    report = FuzzReport()
    for result in schema.get_all_operations():
        operation = result.ok()
        has_body = operation.method.upper() == "POST" and len(operation.body)
        # Without a body there is only a path or query to vary: a quarter of the examples do.
        examples = examples_per_operation if has_body else max(10, examples_per_operation // 4)
        _fuzz(operation, schemathesis.GenerationMode.POSITIVE, base_url, examples, prepare, report)
        if has_body:  # nothing to break without a body
            _fuzz(operation, schemathesis.GenerationMode.NEGATIVE, base_url, examples, prepare, report)
    return report


def _fuzz(
    operation: schemathesis.APIOperation,
    mode: schemathesis.GenerationMode,
    base_url: str,
    max_examples: int,
    prepare: Callable[[schemathesis.Case], None],
    report: FuzzReport,
) -> None:
    @seed(SEED)
    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case: schemathesis.Case) -> None:
        prepare(case)
        response = case.call(base_url=base_url, timeout=60)
        report.num_requests += 1
        report.statuses[response.status_code] = report.statuses.get(response.status_code, 0) + 1
        bad_error = response.status_code >= 400 and not _is_api_error(response.content, operation.path)
        if response.status_code >= 500 or bad_error:
            report.failures.append(
                f"{operation.label} ({mode.value}) -> {response.status_code} {response.text[:200]!r}"
                f" for body {case.body!r:.300}"
            )

    call()
