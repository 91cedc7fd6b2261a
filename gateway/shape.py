"""What routing needs to know of an OpenAI request body, read without validating it all
(the replica validates): the model, an estimate of the tokens and KV blocks it may take,
the start of its prompt for the `prefix` policy, and the parsed body and session for the
`affinity` policy (which hashes the prompt exactly, gateway/prompt_hashes.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pagefleet.gateway.errors import bad_request
from pagefleet.protocol import anthropic, responses
from pagefleet.runtime.response_store import ResponseStore, StoreUnavailable

_CHARS_PER_TOKEN = 4  # a rough estimate of a prompt's tokens from its text
_DEFAULT_CHAT_TOKENS = 256  # what a chat request without max_tokens is assumed to take
_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for completions
PREFIX_CHARS = 256
SESSION_HEADER = "x-session-id"  # a routing hint: a session's requests go where it went before


@dataclass(slots=True)
class RequestShape:
    model: str
    prompt_tokens: int
    max_tokens: int
    num_sequences: int
    prefix: str
    payload: dict[str, Any] = field(default_factory=dict)  # the parsed body
    chat: bool = False  # a chat completions body (else completions)
    session: str | None = None  # `x-session-id`, else the body's `user`: a routing hint

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens * self.num_sequences

    def prompt_blocks(self, block_size: int) -> int:
        return math.ceil(self.prompt_tokens / block_size)

    def blocks(self, block_size: int) -> int:
        return math.ceil(self.prompt_tokens / block_size) + self.num_sequences * math.ceil(self.max_tokens / block_size)


def _text_tokens(value: Any) -> tuple[int, str]:
    """(estimated tokens, text start) of a prompt: a string, token ids, or a list of either."""
    if isinstance(value, str):
        return max(1, len(value) // _CHARS_PER_TOKEN), value[:PREFIX_CHARS]
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return len(value), ",".join(map(str, value[:64]))
    if isinstance(value, list):
        parts = [_text_tokens(item) for item in value]
        return sum(p[0] for p in parts), (parts[0][1] if parts else "")
    return 0, ""


async def routed_payload(path: str, payload: dict[str, Any], store: ResponseStore) -> dict[str, Any]:
    """The body of a request to `path` as the chat body its replica will run, so that its
    prompt is hashed as the engine computes it: an Anthropic Messages body converted, a
    Responses body after the stored conversation of its `previous_response_id`. As it is
    for other paths, or if it does not validate or its conversation cannot be read (the
    replica will say why, and it is routed by load)."""
    try:
        if path.startswith(anthropic.MESSAGES_PATH):
            return anthropic.as_chat_request(anthropic.CountTokensRequest.model_validate(payload)).model_dump(
                exclude_none=True
            )
        if path == responses.RESPONSES_PATH:
            body = responses.ResponsesRequest.model_validate(payload)
            previous = await store.get(body.previous_response_id) if body.previous_response_id else None
            history = previous.conversation if previous is not None else []
            return responses.as_chat_request(body, history).model_dump(exclude_none=True)
    except (ValidationError, StoreUnavailable):
        pass
    return payload


def _input_text(value: Any) -> str:
    """The text of a Responses `input`: a string, or its items' text content."""
    if not isinstance(value, list):
        return value if isinstance(value, str) else ""
    texts = []
    for item in value:
        content = item.get("content", item.get("output")) if isinstance(item, dict) else None
        if isinstance(content, list):  # content parts; a part's text that is not a string counts as none
            texts_of_parts = (part.get("text") for part in content if isinstance(part, dict))
            content = "".join(text for text in texts_of_parts if isinstance(text, str))
        texts.append(content if isinstance(content, str) else "")
    return "\n".join(texts)


def describe(body: bytes, chat: bool) -> RequestShape:
    """The shape of a completions (`chat=False`) or chat completions body; a body that is
    not a JSON object is a Refusal (400). A body without `model` (or with null: optional,
    as in vLLM) has model "" here: the admission names the fleet's one model, if it has one."""
    try:
        payload = json.loads(body)
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(payload, dict):
        raise bad_request("the request body must be a JSON object")
    model = payload.get("model")
    if model is None:
        model = ""
    elif not isinstance(model, str) or not model:
        raise bad_request("model: a model name is required", "model")
    if "input" in payload:  # the Responses API's
        prompt_tokens, prefix = _text_tokens(f"{payload.get('instructions') or ''}\n{_input_text(payload['input'])}")
        max_tokens = payload.get("max_output_tokens") or _DEFAULT_CHAT_TOKENS
    elif chat:
        messages = payload.get("messages") or []
        texts = [str(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
        if isinstance(payload.get("system"), str):  # Anthropic's system prompt
            texts.insert(0, payload["system"])
        prompt_tokens, prefix = _text_tokens("\n".join(texts))
        max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or _DEFAULT_CHAT_TOKENS
    else:
        prompt_tokens, prefix = _text_tokens(payload.get("prompt", ""))
        max_tokens = payload.get("max_tokens") or _DEFAULT_COMPLETION_TOKENS
    num = payload.get("best_of") or payload.get("n") or 1
    if not isinstance(max_tokens, int) or not isinstance(num, int):
        raise bad_request("max_tokens and n must be integers", "max_tokens")
    user = payload.get("user")
    session = user if isinstance(user, str) and user else None
    return RequestShape(model, prompt_tokens, max(1, max_tokens), max(1, num), prefix, payload, chat, session)
