"""Tool calling on `/v1/chat/completions`: the tools into the prompt, `tool_choice` into a
constraint, and the model's answer back into OpenAI's `tool_calls`.

- Prompt (runtime/chat_prompt.py, shared with the gateway): a chat template that knows
  tools gets them as `tools=`; one that does not (such as SmolLM2's) gets them in the
  system message, in the format SmolLM2 was tuned on, calls answered as
  `<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`.
- `tool_choice`: `none` leaves the output alone; `auto` (the default with tools) parses
  what the model wrote, in SmolLM2's list format or Hermes' one-object-per-tag format;
  `required` constrains the output to a JSON list of calls of the given functions (one
  call only with `parallel_tool_calls: false`) and a named function constrains it to that
  function's arguments, so even a small model returns valid arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagefleet.engine.sample.structured_outputs import StructuredOutputsParams
from pagefleet.engine.server.errors import OpenAIError
from pagefleet.protocol.openai import ChatCompletionRequest, Tool

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolPlan:
    """What a chat request's tools ask of the generation and of its answer."""

    tools: list[Tool]
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolPlan | None:
        """None without tools. Raises OpenAIError (400) for a tool_choice naming a function
        that is not among the tools, or asking for tools when there are none."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none"):
                raise OpenAIError(400, "tool_choice: there are no tools to choose from", "tool_choice")
            return None
        if choice is None or isinstance(choice, str):
            return cls(body.tools, choice or "auto", parallel=body.parallel_tool_calls)
        names = [tool.function.name for tool in body.tools]
        if choice.function.name not in names:
            raise OpenAIError(
                400,
                f"tool_choice: {choice.function.name!r} is not one of the tools ({', '.join(names)})",
                "tool_choice",
            )
        return cls(body.tools, "named", choice.function.name, body.parallel_tool_calls)

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that `required` and a named function impose."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self._function(self.named).parameters or _ANY_ARGUMENTS)
        if self.choice != "required":
            return None
        # Each function's parameters become a definition of the whole schema, with their
        # own definitions beside them: a `$ref` (pydantic writes one for every nested model)
        # points at the schema's root, which is now the list of calls.
        definitions: dict[str, Any] = {}
        one_call = []
        for tool in self.tools:
            name = tool.function.name
            definitions.update(_hoisted(name, tool.function.parameters or _ANY_ARGUMENTS))
            one_call.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{name}"}},
                    "required": ["name", "arguments"],
                }
            )
        calls: dict[str, Any] = {"type": "array", "items": {"anyOf": one_call}, "minItems": 1, "$defs": definitions}
        if not self.parallel:
            calls["maxItems"] = 1
        return StructuredOutputsParams(json=calls)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, tool calls) of the model's answer; text that is no call stays content.
        A forced call (named or required) has empty content, as vLLM answers it, and one cut
        off by max_tokens is no call at all (never a half call with arguments `{`)."""
        if self.choice in ("named", "required"):
            return "", self._forced_calls(text)
        calls: list[ParsedCall] = []
        for match in _TOOL_CALL.finditer(text):
            try:
                calls += calls_of(json.loads(match.group(1).strip()))
            except (ValueError, TypeError, KeyError, AttributeError):
                return text, []  # not a well-formed call: the text is the answer
        if not calls:
            return text, []
        content = _TOOL_CALL.sub("", text).strip()
        return content or None, calls

    def _forced_calls(self, text: str) -> list[ParsedCall]:
        try:
            value = json.loads(text)
            return [ParsedCall(str(self.named), json.dumps(value))] if self.choice == "named" else calls_of(value)
        except (ValueError, TypeError, KeyError, AttributeError):
            return []

    def _function(self, name: str | None) -> Any:
        return next(tool.function for tool in self.tools if tool.function.name == name)


def _hoisted(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters as definitions of an enclosing schema: the parameters under
    `name`, their own `$defs` (or `definitions`) under `name.<definition>`, every `$ref` to
    them (or to the parameters' root, `#`) rewritten to match."""

    def rewrite(value: Any) -> Any:
        if isinstance(value, list):
            return [rewrite(item) for item in value]
        if not isinstance(value, dict):
            return value
        out = {key: rewrite(item) for key, item in value.items()}
        ref = value.get("$ref")
        if isinstance(ref, str):
            for prefix in ("#/$defs/", "#/definitions/"):
                if ref.startswith(prefix):
                    out["$ref"] = f"#/$defs/{name}.{ref[len(prefix) :]}"
            if ref == "#":
                out["$ref"] = f"#/$defs/{name}"
        return out

    nested = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    hoisted = {name: rewrite({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")})}
    hoisted.update({f"{name}.{key}": rewrite(schema) for key, schema in nested.items()})
    return hoisted


def calls_of(value: Any) -> list[ParsedCall]:
    """Calls from `{"name", "arguments"}` objects, alone or in a list ("parameters" too)."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        arguments = item.get("arguments", item.get("parameters", {}))
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append(ParsedCall(str(item["name"]), text))
    return calls
