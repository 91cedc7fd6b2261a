"""Streamed chat with tools (`tool_choice` auto or required): content deltas as they come,
and each tool call as a `tool_calls` delta as soon as its text is complete, as vLLM streams
them; a client's first byte never waits for the whole answer.

- auto: text outside `<tool_call>...</tool_call>` is content, sent at once except a tail
  that may be the start of the tag; a call is sent when its closing tag (or the end)
  arrives. A tag holding no well-formed call goes out as content, tag and all.
- required: the answer is a JSON list of calls (tools.py constrains it); each call is sent
  when its object closes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.server.events import ChunkWriter, finish_reason, sse
from pagefleet.engine.server.generation import DeltaTracker, Outputs, choice_deltas
from pagefleet.engine.server.tools import ParsedCall, ToolPlan, calls_of

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class CallStream:
    """One choice's growing text, turned into deltas: {"content": ...} or {"tool_calls": [...]}."""

    def __init__(self, plan: ToolPlan) -> None:
        self.required = plan.choice == "required"
        self.pending = ""  # text received, not yet turned into deltas
        self.in_call = False  # auto: inside an open tag
        self.num_calls = 0
        # required's scan of the JSON: where it got to, nesting, inside a string, the open call
        self._scanned, self._depth, self._in_string, self._escaped, self._object_start = 0, 0, False, False, -1

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.pending += text
        return self._required() if self.required else self._auto(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """What the end of the text releases: a call without its closing tag, a held tail."""
        return [] if self.required else self._auto(final=True)

    def _auto(self, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            if not self.in_call:
                start = self.pending.find(_OPEN)
                if start < 0:
                    keep = 0 if final else _partial_tag_length(self.pending)
                    deltas += self._content(self.pending[: len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep :]
                    return deltas
                deltas += self._content(self.pending[:start])
                self.pending, self.in_call = self.pending[start + len(_OPEN) :], True
            end = self.pending.find(_CLOSE)
            if end < 0 and not final:
                return deltas
            body = self.pending if end < 0 else self.pending[:end]
            self.pending = "" if end < 0 else self.pending[end + len(_CLOSE) :]
            self.in_call = False
            try:
                deltas += self._calls(calls_of(json.loads(body.strip())))
            except (ValueError, TypeError, KeyError, AttributeError):  # no call after all: it was text
                deltas += self._content(_OPEN + body + ("" if end < 0 else _CLOSE))
            if end < 0:
                return deltas

    def _required(self) -> list[dict[str, Any]]:
        """Scan the JSON list for objects at its top level; each one closed is a call."""
        deltas: list[dict[str, Any]] = []
        for index in range(self._scanned, len(self.pending)):
            char = self.pending[index]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
                if char == "{" and self._depth == 2:
                    self._object_start = index
            elif char in "}]":
                if char == "}" and self._depth == 2:
                    try:
                        deltas += self._calls(calls_of(json.loads(self.pending[self._object_start : index + 1])))
                    except (ValueError, TypeError, KeyError, AttributeError):
                        pass  # not a call (the constraint should not allow it): nothing to send
                self._depth -= 1
        self._scanned = len(self.pending)
        return deltas

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text or (self.num_calls and not text.strip()):  # the whitespace between calls is no answer
            return []
        return [{"content": text}]

    def _calls(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            deltas.append({"tool_calls": [{"index": self.num_calls, **call.as_openai()}]})
            self.num_calls += 1
        return deltas


def _partial_tag_length(text: str) -> int:
    """The length of the longest end of `text` that begins the opening tag."""
    for length in range(min(len(text), len(_OPEN) - 1), 0, -1):
        if _OPEN.startswith(text[-length:]):
            return length
    return 0


async def stream_tool_answers(
    stream: Outputs, chunk: ChunkWriter, plan: ToolPlan, num_choices: int, prompt: list[int], token_ids: bool
) -> AsyncIterator[str]:
    """Per choice: the role, then its deltas as the text grows, the last with the finish
    reason ("tool_calls" when it called any); then usage (if asked) and [DONE]. With
    `token_ids` (vLLM's `return_token_ids`) every generated id goes out in exactly one chunk."""
    streams = {i: CallStream(plan) for i in range(num_choices)}
    ids_sent = dict.fromkeys(range(num_choices), 0)
    prompt_tokens = len(prompt)
    for i in range(num_choices):
        opening = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield chunk(
            [opening], chunk.so_far(prompt_tokens, 0), **({"prompt_token_ids": prompt} if token_ids and i == 0 else {})
        )
    tracker = DeltaTracker()
    final: RequestOutput | None = None
    async with aclosing(choice_deltas(stream, tracker)) as news:
        async for output, completion, delta in news:
            final, i = output, completion.index
            tracker.sent(i, completion)
            call_stream = streams[i]
            deltas = call_stream.feed(delta.text) + (call_stream.finish() if delta.is_last else [])
            so_far = chunk.so_far(prompt_tokens, len(completion.token_ids))
            choices = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            if delta.is_last:
                reason = finish_reason(completion.finish_reason)
                called = call_stream.num_calls > 0 and reason == "stop"
                choices.append(
                    {"index": i, "delta": {}, "logprobs": None, "finish_reason": "tool_calls" if called else reason}
                )
            for n, choice in enumerate(choices):
                if token_ids and n == len(choices) - 1:  # the ids so far ride on the last chunk
                    choice["token_ids"] = completion.token_ids[ids_sent[i] :]
                    ids_sent[i] = len(completion.token_ids)
                yield chunk([choice], so_far)
    if chunk.include_usage and final is not None:
        yield chunk([], chunk.usage([final]))
    yield sse("[DONE]")
