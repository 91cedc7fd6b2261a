"""Conversations to prompt token ids through the tokenizer's chat template: one helper for
`LLM.chat`, the server's chat route and its /tokenize. The text is rendered by
runtime/chat_prompt.py, which the gateway also uses to predict the same tokens."""

from __future__ import annotations

from typing import Any

from pagefleet.engine.errors import InvalidParameterError
from pagefleet.runtime.chat_prompt import ChatTemplateError, Message, render_chat
from pagefleet.runtime.chat_prompt import template_takes_tools as _takes_tools

__all__ = ["Message", "apply_chat_template", "template_takes_tools"]


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` argument itself."""
    return _takes_tools(getattr(tokenizer, "chat_template", None))


def apply_chat_template(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = True,
    tools: list[Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """The token ids of `messages` (and `tools`, for a template that takes them) as the
    model expects them.

    Raises:
        InvalidParameterError: (ValueError) on "messages" if the tokenizer has no template
            or the template refuses the conversation.
    """
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template:
        raise InvalidParameterError("messages", "this model's tokenizer has no chat template; use a plain prompt")
    try:
        text = render_chat(
            template,
            messages,
            tokenizer.special_tokens_map,
            add_generation_prompt,
            tools or None,
            continue_final_message,
        )
    except ChatTemplateError as error:
        raise InvalidParameterError("messages", f"the chat template refused the conversation: {error}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
