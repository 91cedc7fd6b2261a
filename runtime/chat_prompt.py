"""A chat request as the prompt text the model reads: its messages (with tools written in
when the template cannot take them) through the model's Jinja chat template.

The engine and the gateway both render chat prompts here, so the gateway's prefix hashes
(gateway/prompt_hashes.py) are those of the very tokens the engine will compute. Rendering
follows transformers' `apply_chat_template`: a sandboxed Jinja environment with
`trim_blocks`, `lstrip_blocks` and loop controls, its `tojson`, `raise_exception` and
`strftime_now`, and the tokenizer's special tokens (`bos_token`, `eos_token`, ...) in scope.
The text is then tokenized without adding special tokens (the template wrote them).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagefleet.protocol.openai import ChatCompletionRequest, ChatMessage

Message = dict[str, Any]  # {"role": ..., "content": ...}

_TOOLS_SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. "
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
    "If none of the functions can be used, answer in plain text.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, answer with\n"
    '<tool_call>[{{"name": "func_name1", "arguments": {{"argument1": "value1"}}}}]</tool_call>'
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or does not compile."""


def template_takes_tools(template: str | None) -> bool:
    """Whether a chat template renders a `tools` argument itself."""
    return "tools" in (template or "")


def chat_messages(body: ChatCompletionRequest, takes_tools: bool) -> list[Message]:
    """The request's messages for the chat template: earlier calls written out as the model
    writes them, and the tools in the system message when the template cannot take them
    (SmolLM2's format: definitions inside `<tools></tools>`)."""
    messages = [_message(message) for message in body.messages]
    if not body.tools or takes_tools or body.tool_choice == "none":
        return messages
    definitions = json.dumps([tool.function.model_dump(exclude_none=True) for tool in body.tools])
    system = _TOOLS_SYSTEM_PROMPT.format(tools=definitions)
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + system}
    else:
        messages.insert(0, {"role": "system", "content": system})
    return messages


def template_tools(body: ChatCompletionRequest, takes_tools: bool) -> list[dict[str, Any]] | None:
    """The `tools` the template gets (None when it does not take them)."""
    if not takes_tools or not body.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


def _message(message: ChatMessage) -> Message:
    content = message.text()
    if message.tool_calls:
        calls = [
            {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)} for c in message.tool_calls
        ]
        content = (content + "\n" if content else "") + f"<tool_call>{json.dumps(calls)}</tool_call>"
    return {"role": message.role, "content": content}


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' (and so every template) does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 (the name templates call it with)
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(template)


def render_chat(
    template: str,
    messages: list[Message],
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of a conversation.

    Args:
        template: the model's Jinja chat template.
        messages: role/content dicts (keys whose value is None are dropped, as transformers does).
        special_tokens: the tokenizer's special tokens by role (`bos_token`, `eos_token`, ...).
        continue_final_message: end the text right after the last message's content (no
            end-of-turn), so the answer continues it, as transformers cuts it.
    Raises:
        ChatTemplateError: the template refused the conversation or does not compile, or
            the last message's text is not in what it rendered.
    """
    conversation = [{key: value for key, value in m.items() if value is not None} for m in messages]
    try:
        text = _compile(template).render(
            **special_tokens,
            messages=conversation,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
    except jinja2.exceptions.TemplateError as error:
        raise ChatTemplateError(str(error)) from error
    if not continue_final_message:
        return text
    final = str(messages[-1].get("content") or "")
    for candidate in (final, final.strip()):
        if candidate and candidate in text:
            return text[: text.rindex(candidate) + len(candidate)]
    raise ChatTemplateError("continue_final_message: the last message's text is not in the rendered chat")
