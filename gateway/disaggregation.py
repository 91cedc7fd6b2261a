"""The two requests of a disaggregated one (vLLM's `kv_transfer_params` flow, as its P/D
proxies send them): the prompt alone to a prefill replica, then the whole request, with
what the prefill replica answered, to a decode replica that pulls the prompt's KV.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagefleet.protocol import kv_transfer

PREFILL_REPLICA_HEADER = "x-pagefleet-prefill-replica"  # on answers: which replica ran the prompt


@dataclass(slots=True, frozen=True)
class Prefilled:
    """A prompt computed on a prefill replica: where its KV waits, and which replica holds it."""

    transfer: dict[str, Any]  # the prefill replica's kv_transfer_params
    replica_id: str


# What a prefill needs none of: the answer is one token, read by nobody but the gateway.
_NOT_FOR_PREFILL = (
    "stream",
    "stream_options",
    "best_of",
    "use_beam_search",
    "logprobs",
    "top_logprobs",
    "echo",
    "structured_outputs",
    "response_format",
    "min_tokens",
)


def prefill_body(payload: dict[str, Any]) -> bytes:
    """The prefill replica's request: the same prompt (chat template and tools included, so
    the tokens agree), one token, one sample, no stream, its blocks kept for the pull."""
    body = {key: value for key, value in payload.items() if key not in _NOT_FOR_PREFILL}
    body.update(max_tokens=1, n=1, kv_transfer_params=kv_transfer.for_prefill())
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return json.dumps(body).encode()


def decode_body(payload: dict[str, Any], transfer: dict[str, Any]) -> bytes:
    """The decode replica's request: the client's own, with where to pull the prompt's KV."""
    return json.dumps({**payload, "kv_transfer_params": transfer}).encode()


def transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a prefill replica's JSON answer (None if it has none)."""
    try:
        return kv_transfer.of_prefill_answer(json.loads(answer))
    except (ValueError, AttributeError):
        return None
