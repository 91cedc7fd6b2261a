"""The wire shapes shared by completions and chat: server-sent events, stream chunks,
usage and finish reasons as OpenAI clients read them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pagefleet.engine.outputs import RequestOutput


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@dataclass(slots=True)
class ChunkWriter:
    """Server-sent events of one streamed response; with include_usage every chunk has a
    `usage` field (null until the last), as OpenAI sends them."""

    response_id: str
    kind: str  # "text_completion" or "chat.completion.chunk"
    model: str
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def __call__(self, choices: list[dict[str, Any]], usage_value: dict[str, Any] | None = None) -> str:
        data: dict[str, Any] = {
            "id": self.response_id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            data["usage"] = usage_value
        return sse(data)


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(o.usage.prompt_tokens for o in outputs)
    completion = sum(o.usage.completion_tokens for o in outputs)
    result: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    cached = sum(o.usage.cached_prompt_tokens for o in outputs)
    if cached:
        result["prompt_tokens_details"] = {"cached_tokens": cached}
    return result


def finish_reason(reason: str | None) -> str | None:
    return None if reason == "abort" else reason
