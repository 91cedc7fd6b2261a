"""The wire shapes shared by completions and chat: server-sent events, stream chunks,
usage and finish reasons as OpenAI clients read them."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.protocol.openai import StreamOptions

if TYPE_CHECKING:
    from pagefleet.engine.server.settings import ServerSettings


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@dataclass(slots=True)
class ChunkWriter:
    """Server-sent events of one streamed response. With include_usage every chunk has a
    `usage` field, null until the last, as OpenAI sends them; with continuous_usage each
    chunk's is its choice's usage so far (vLLM's `continuous_usage_stats`)."""

    response_id: str
    kind: str  # "text_completion" or "chat.completion.chunk"
    model: str
    include_usage: bool
    continuous_usage: bool = False
    token_details: bool = False  # --enable-prompt-tokens-details: what `usage` says of the prompt
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def for_request(
        cls, response_id: str, kind: str, model: str, options: StreamOptions | None, settings: ServerSettings
    ) -> ChunkWriter:
        """As vLLM decides it: `--enable-force-include-usage` puts the running usage in every
        chunk and the total at the end, whatever the request's stream_options say; otherwise
        usage at the end if `include_usage` asks, in every chunk too if `continuous_usage_stats`
        asks as well."""
        if settings.enable_force_include_usage:
            include = continuous = True
        elif options is None:
            include = continuous = False
        else:
            include = options.include_usage
            continuous = include and options.continuous_usage_stats
        return cls(response_id, kind, model, include, continuous, settings.enable_prompt_tokens_details)

    def usage(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        return usage(outputs, self.token_details)

    def so_far(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any] | None:
        """A chunk's usage so far with continuous usage; None (no figure yet) otherwise."""
        if not self.continuous_usage:
            return None
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def __call__(self, choices: list[dict[str, Any]], usage_value: dict[str, Any] | None = None, **fields: Any) -> str:
        """One chunk; `fields` go beside `choices` (vLLM's `prompt_token_ids`)."""
        data: dict[str, Any] = {
            "id": self.response_id,
            "object": self.kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **fields,
        }
        if self.include_usage:
            data["usage"] = usage_value
        return sse(data)


def token_name(token_id: int, text: str, as_ids: bool) -> str:
    """How logprobs name a token: its text, or vLLM's `token_id:<id>` when asked."""
    return f"token_id:{token_id}" if as_ids else text


def prompt_logprobs(output: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position (the first has none), token id ->
    its logprob, rank and text."""
    if output.prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token_id, lp in position.items()
        }
        for position in output.prompt_logprobs
    ]


def usage(outputs: list[RequestOutput], details: bool) -> dict[str, Any]:
    """The usage object; with `details` (--enable-prompt-tokens-details) the prompt's cached
    tokens, 0 included, as `prompt_tokens_details` (vLLM 0.32 sends it so), else null."""
    prompt = sum(o.usage.prompt_tokens for o in outputs)
    completion = sum(o.usage.completion_tokens for o in outputs)
    cached = sum(o.usage.cached_prompt_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached} if details else None,
    }


def finish_reason(reason: str | None) -> str | None:
    return None if reason == "abort" else reason
