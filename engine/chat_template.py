"""Conversations to prompt token ids through the tokenizer's chat template: one helper for
`LLM.chat`, the server's chat route and its /tokenize."""

from __future__ import annotations

from typing import Any

from pagefleet.engine.errors import InvalidParameterError

Message = dict[str, Any]  # {"role": ..., "content": ...}


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument itself."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def apply_chat_template(
    tokenizer: Any, messages: list[Message], add_generation_prompt: bool = True, tools: list[Any] | None = None
) -> list[int]:
    """The token ids of `messages` (and `tools`, for a template that takes them) as the
    model expects them.

    Raises:
        InvalidParameterError: (ValueError) on "messages" if the tokenizer has no template.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidParameterError("messages", "this model's tokenizer has no chat template; use a plain prompt")
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **extra)
    # transformers returns a BatchEncoding (a dict) or a plain list, depending on version.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
