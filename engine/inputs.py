"""The prompt shapes the engine takes, as vLLM takes them: a string, a list of token ids,
`{"prompt": "..."}` (vLLM's `TextPrompt`) or `{"prompt_token_ids": [...]}` (`TokensPrompt`).
Everything past `add_request` sees only a string or token ids."""

from __future__ import annotations

from typing import Any, TypeAlias, TypedDict

from pagefleet.engine.errors import InvalidParameterError


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


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
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return str(prompt["prompt"])
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return list(prompt["prompt_token_ids"])
    raise InvalidParameterError(
        "prompt",
        'a prompt dict holds either "prompt" (a string) or "prompt_token_ids" (a list of ints); '
        f"got keys {sorted(keys)}",
    )
