"""Tool calling's parts without a server: the plan from tools and tool_choice, the
constraint it imposes, the parsers of both call formats (whole, and streamed as the text
grows), and the prompt's messages."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagefleet.engine.server.errors import OpenAIError
from pagefleet.engine.server.tool_stream import CallStream
from pagefleet.engine.server.tools import ToolPlan
from pagefleet.protocol.openai import ChatCompletionRequest
from pagefleet.runtime.chat_prompt import chat_messages

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def _request(**fields) -> ChatCompletionRequest:  # type: ignore[no-untyped-def]
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], **fields}
    )


def _plan(**fields) -> ToolPlan:  # type: ignore[no-untyped-def]
    plan = ToolPlan.of(_request(tools=[WEATHER, TIME], **fields))
    assert plan is not None
    return plan


def test_auto_parses_smollm2_and_hermes_formats_and_leaves_plain_text_alone() -> None:
    plan = _plan()
    assert plan.choice == "auto" and plan.constraint() is None
    smollm2 = (
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]</tool_call>'
    )
    content, calls = plan.parse(smollm2)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    hermes = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = plan.parse(hermes)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather", "get_time"]
    unclosed = '<tool_call>{"name": "get_time", "arguments": {}}'  # the stop token came first
    assert [c.name for c in plan.parse(unclosed)[1]] == ["get_time"]
    assert plan.parse("It is sunny in Paris.") == ("It is sunny in Paris.", [])
    broken = "<tool_call>[{not json</tool_call>"
    assert plan.parse(broken) == (broken, [])
    call = plan.parse(smollm2)[1][0].as_openai()
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"


def test_required_and_named_choices_constrain_the_output() -> None:
    required = _plan(tool_choice="required").constraint()
    assert required is not None and isinstance(required.json, dict)
    good = [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, required.json)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "launch", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required.json)
    single = _plan(tool_choice="required", parallel_tool_calls=False).constraint()
    assert single is not None and single.json["maxItems"] == 1  # type: ignore[index]
    named = _plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    constraint = named.constraint()
    assert constraint is not None and constraint.json == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert [(c.name, c.arguments) for c in named.parse('{ "city" : "Rome" }')[1]] == [
        ("get_weather", '{"city": "Rome"}')
    ]
    assert _plan(tool_choice="none").parses_calls is False


def test_a_required_call_keeps_the_references_of_nested_models() -> None:
    """Each tool's `$defs` move to the root of the list-of-calls schema, its `$ref`s with them:
    the schema validates what it should, and the grammar engine compiles it."""
    import xgrammar

    address = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    booking = {
        "type": "object",
        "properties": {"address": {"$ref": "#/$defs/Address"}, "definitions": {"type": "string"}},
        "required": ["address"],
        "$defs": {"Address": address},
    }
    tools = [
        {"type": "function", "function": {"name": "book", "parameters": booking}},
        {"type": "function", "function": {"name": "grow", "parameters": tree}},
    ]
    plan = ToolPlan.of(_request(tools=tools, tool_choice="required"))
    assert plan is not None and (constraint := plan.constraint()) is not None
    schema = constraint.json
    good = [
        {"name": "book", "arguments": {"address": {"city": "Lyon"}, "definitions": "a property, kept"}},
        {"name": "grow", "arguments": {"kids": [{"kids": []}]}},
    ]
    jsonschema.validate(good, schema)
    for bad in ([{"name": "book", "arguments": {"address": {}}}], [{"name": "grow", "arguments": {"kids": [1]}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    xgrammar.Grammar.from_json_schema(json.dumps(schema))


def test_bad_tool_choices_are_400s_naming_the_field() -> None:
    for fields in (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required"},
    ):
        with pytest.raises(OpenAIError) as refused:
            ToolPlan.of(_request(**fields))
        assert refused.value.status == 400 and refused.value.param == "tool_choice"
    assert ToolPlan.of(_request()) is None


def test_the_prompt_carries_the_tools_and_earlier_calls() -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": history, "tools": [WEATHER]})
    messages = chat_messages(body, takes_tools=False)
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert "<tools>" in messages[0]["content"] and '"get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    assert messages[3] == {"role": "tool", "content": '{"sky": "clear"}'}
    assert "<tools>" not in chat_messages(body, takes_tools=True)[0]["content"]


def test_a_forced_call_cut_off_is_no_call_at_all() -> None:
    """max_tokens cut the constrained JSON: no half call with arguments `{`, and no content."""
    named = _plan(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.parse('{"city": "Ro') == ("", [])
    required = _plan(tool_choice="required")
    assert required.parse('[{"name": "get_weather", "arguments": {"ci') == ("", [])


def _streamed(plan: ToolPlan, pieces: list[str]) -> list[dict]:  # type: ignore[type-arg]
    stream = CallStream(plan)
    deltas = [delta for piece in pieces for delta in stream.feed(piece)]
    return deltas + stream.finish()


def _calls_of(deltas: list[dict]) -> list[tuple[int, str, dict]]:  # type: ignore[type-arg]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    return [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_streamed_auto_sends_content_at_once_and_each_call_when_it_closes() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # tags split across deltas
    stream = CallStream(_plan())
    first = stream.feed(pieces[0]) + stream.feed(pieces[1])
    assert first == [{"content": "Let"}, {"content": " me"}]  # content goes out as it comes
    deltas = _streamed(_plan(), pieces)
    assert "".join(d.get("content", "") for d in deltas) == "Let me look.\n"
    assert _calls_of(deltas) == [(0, "get_weather", {"city": "Oslo"}), (1, "get_time", {})]
    # The first call goes out before the second one's text arrived.
    cut = text.index("</tool_call>") + len("</tool_call>")
    assert _calls_of(_streamed(_plan(), [text[:cut]])) == [(0, "get_weather", {"city": "Oslo"})]
    # A tag without a well-formed call was text after all; an unclosed call at the end is a call.
    assert _streamed(_plan(), ["a <tool_call>[{not json</tool_call> b"]) == [
        {"content": "a "},
        {"content": "<tool_call>[{not json</tool_call>"},
        {"content": " b"},
    ]
    assert _calls_of(_streamed(_plan(), ['<tool_call>{"name": "get_time", "arguments": {}}'])) == [(0, "get_time", {})]
    assert _streamed(_plan(), ["5 <", "tool"]) == [{"content": "5 "}, {"content": "<tool"}]


def test_streamed_required_sends_each_call_when_its_object_closes() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "a \\"}{ b"}}, {"name": "get_time", "arguments": {}}]'
    plan = _plan(tool_choice="required")
    stream = CallStream(plan)
    cut = text.index("}}") + 2
    assert _calls_of(stream.feed(text[:cut])) == [(0, "get_weather", {"city": 'a "}{ b'})]
    assert _calls_of(stream.feed(text[cut:])) == [(1, "get_time", {})]
    assert _calls_of(_streamed(plan, [text[i : i + 1] for i in range(len(text))])) == _calls_of(_streamed(plan, [text]))
    assert _streamed(plan, ['[{"name": "get_weather", "argu']) == []  # cut off: nothing
