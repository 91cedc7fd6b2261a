"""The prompt shapes the engine takes, as vLLM takes them: a string, a list of token ids,
`{"prompt": "..."}` (vLLM's `TextPrompt`) or `{"prompt_token_ids": [...]}` (`TokensPrompt`).
Everything past `add_request` sees only a string or token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias, TypedDict

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.protocol.block_hash import chain_root


class TextPrompt(TypedDict, total=False):
    prompt: str  # required
    cache_salt: str  # vLLM's: requests with different salts never share prefix-cache blocks


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]  # required
    cache_salt: str


PromptType: TypeAlias = str | list[int] | TextPrompt | TokensPrompt


def is_single_prompt(value: Any) -> bool:
    """True for one prompt, False for a list of prompts (as `LLM.generate` gets either)."""
    return isinstance(value, str | dict) or (isinstance(value, list) and bool(value) and isinstance(value[0], int))


def parse_prompt(prompt: Any) -> str | list[int]:
    """The text or token ids of one prompt in any accepted shape.

    Raises:
        InvalidParameterError: for a dict of another shape (naming the keys it may have).
    """
    if not isinstance(prompt, dict):
        return prompt  # type: ignore[no-any-return]
    keys = set(prompt) - {"cache_salt"}
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return str(prompt["prompt"])
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return list(prompt["prompt_token_ids"])
    raise InvalidParameterError(
        "prompt",
        'a prompt dict holds either "prompt" (a string) or "prompt_token_ids" (a list of ints), and '
        f'optionally "cache_salt"; got keys {sorted(prompt)}',
    )


def prompt_cache_salt(prompt: Any) -> str | None:
    """The `cache_salt` of a prompt dict (None for other shapes or without one).

    Raises:
        InvalidParameterError: for a salt that is not a non-empty string.
    """
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return None
    salt = prompt["cache_salt"]
    if not isinstance(salt, str) or not salt:
        raise InvalidParameterError("cache_salt", "must be a non-empty string")
    return salt


@dataclass(slots=True, frozen=True)
class PreparedPrompt:
    """A prompt tokenized ahead (`LLMEngine.prepare_prompt`, on any thread), so that adding
    its request on the engine thread tokenizes nothing."""

    text: str | None  # the prompt's text, if it came as text
    token_ids: list[int]  # what the engine computes: tokenized, then truncated
    cache_salt: str | None


def prefix_hash_root(lora_request: LoRARequest | None, cache_salt: str | None, long_rope: bool = False) -> int:
    """The first link of a request's prefix-cache hash chain: an adapter's KV, a salted
    request's, or a LongRoPE model's long prompt's is its own (protocol/block_hash.py;
    routers compute the same, but for `long_rope`)."""
    return chain_root(lora_request.lora_name if lora_request is not None else None, cache_salt, long_rope)
