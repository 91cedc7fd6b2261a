"""OpenAI's Responses API on the engine server, through the official `openai` client: the
chat route's answer, typed stream events in order, stored responses (retrieve, input items,
delete), conversations through `previous_response_id`, background responses and their
cancel, and refusals in OpenAI's shape. (A tool-call round trip and a JSON schema on
SmolLM2: test_smollm2_server.py; across replicas and the gateway: tests/gateway.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import redis as redis_sync

from tests.processes import EngineServer, RedisProcess, idle_with_every_block_free, start_server, stop_server, wait_for

INSTRUCTIONS, QUESTION = "Be brief.", "Hello there"


@pytest.fixture(scope="module")
def client(tiny_server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, model: str, messages: list[dict[str, str]], max_tokens: int) -> str:
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return str(answer.choices[0].message.content)


def test_a_response_is_the_chat_routes_answer_and_is_stored(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    args = dict(model=tiny_server.model, instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0)
    response = client.responses.create(input=QUESTION, **args)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == _chat(client, tiny_server.model, messages, 8)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"] and response.output[0].role == "assistant"
    prompt_tokens = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": messages}).json()["count"]
    assert response.usage.input_tokens == prompt_tokens and response.usage.output_tokens == 8
    assert response.usage.total_tokens == prompt_tokens + 8
    # Stored (the default): the same object back, its input items, then gone once deleted.
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    items = client.responses.input_items.list(response.id)
    assert [(item.type, item.role, item.content[0].text) for item in items.data] == [("message", "user", QUESTION)]
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    unstored = client.responses.create(input=QUESTION, store=False, **args)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    wait_for(lambda: idle_with_every_block_free(tiny_server))


def test_a_streamed_response_sends_the_typed_events_in_order(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    args = dict(model=tiny_server.model, input=QUESTION, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text and final.usage.output_tokens == 12
    item_ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert item_ids == {final.output[0].id}
    # The client's own accumulator takes the events (it checks their order and ids), and
    # the streamed response was stored.
    with client.responses.stream(**args) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == whole.output_text
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    """The follow-up sees the earlier turns (but not their instructions, as OpenAI), and its
    prompt's start comes from the prefix cache."""
    model = tiny_server.model
    first = client.responses.create(model=model, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=6)
    second = client.responses.create(
        model=model, previous_response_id=first.id, input="And again?", max_output_tokens=6, temperature=0
    )
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And again?"},
    ]
    assert second.output_text == _chat(client, model, history, 6)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=model, previous_response_id="resp_nope", input="hi", max_output_tokens=2)
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_background_response_finishes_or_is_cancelled(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    model = tiny_server.model
    done = client.responses.create(model=model, input=QUESTION, max_output_tokens=4, background=True)
    assert done.background and done.status == "in_progress"
    items_while_running = client.responses.input_items.list(done.id).data  # their ids stay
    finished = wait_for(lambda: (r := client.responses.retrieve(done.id)).status == "incomplete" and r)
    assert finished.usage.output_tokens == 4 and finished.output_text
    assert client.responses.input_items.list(done.id).data[0].id == items_while_running[0].id
    # A long one, cancelled while it runs: its blocks are freed, and it says so.
    long = client.responses.create(
        model=model, input=QUESTION, max_output_tokens=400, background=True, extra_body={"ignore_eos": True}
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"  # again: as it is
    wait_for(lambda: idle_with_every_block_free(tiny_server))
    foreground = client.responses.create(model=model, input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)


def test_bad_requests_are_refused_in_openais_shape(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    url, model = f"{tiny_server.url}/v1/responses", tiny_server.model
    refused = {
        "no input": {"model": model, "input": []},
        "an image": {
            "model": model,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}],
        },
        "a hosted tool": {"model": model, "input": "hi", "tools": [{"type": "web_search"}]},
        "background, not stored": {"model": model, "input": "hi", "background": True, "store": False},
        "background, streamed": {"model": model, "input": "hi", "background": True, "stream": True},
        "a schema-less json_schema": {"model": model, "input": "hi", "text": {"format": {"type": "json_schema"}}},
        "a negative temperature": {"model": model, "input": "hi", "temperature": -1},
    }
    for case, body in refused.items():
        answer = httpx.post(url, json=body)
        assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error", case
    missing = httpx.post(url, json={"model": "no-such-model", "input": "hi"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_never")
    wait_for(lambda: idle_with_every_block_free(tiny_server))


def test_auto_truncation_drops_the_oldest_turns(tiny_server: EngineServer) -> None:
    """The tiny model takes 512 tokens: a conversation longer than that is a 400 unless
    `truncation: auto`, which drops turns from its start (the instructions stay)."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 60} for i in range(12)]
    body = {"model": tiny_server.model, "instructions": INSTRUCTIONS, "input": turns, "max_output_tokens": 4}
    assert httpx.post(f"{tiny_server.url}/v1/responses", json=body).status_code == 400
    answer = httpx.post(f"{tiny_server.url}/v1/responses", json={**body, "truncation": "auto"})
    assert answer.status_code == 200, answer.text
    assert 400 < answer.json()["usage"]["input_tokens"] <= 512 - 4


def test_stored_responses_live_in_redis_and_an_outage_loses_no_block(
    tiny_llama: Path, redis_server: RedisProcess, tmp_path: Path
) -> None:
    """With --redis-url a stored response is a Redis key (so another replica can read it);
    with Redis gone, storing answers 503 in OpenAI's shape and frees the request's blocks,
    while a response that is not stored is still served."""
    flags = ("--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "8", "--redis-url", redis_server.url)
    server = start_server(str(tiny_llama), tmp_path / "serve.log", *flags)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        stored = client.responses.create(model=server.model, input=QUESTION, max_output_tokens=3)
        keys = redis_sync.Redis.from_url(redis_server.url).keys("pagefleet:response:*")
        assert keys == [f"pagefleet:response:{stored.id}".encode()]
        redis_server.stop()
        body = {"model": server.model, "input": QUESTION, "max_output_tokens": 3}
        for extra in ({}, {"background": True}):
            refused = httpx.post(f"{server.url}/v1/responses", json={**body, **extra}, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == 503, refused.text
        assert httpx.post(f"{server.url}/v1/responses", json={**body, "store": False}, timeout=30).status_code == 200
        wait_for(lambda: idle_with_every_block_free(server))
    finally:
        stop_server(server)
