"""Anthropic's Messages API on the engine server, through the official `anthropic` client:
the same answer as the chat route, streamed in Anthropic's event order, token counts, and
errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.processes import EngineServer, idle_with_every_block_free, wait_for

SYSTEM, QUESTION = "Be brief.", "Hello there"
GREEDY = {"temperature": 0.0}  # still Anthropic's field, though its newest client no longer names it


@pytest.fixture(scope="module")
def client(tiny_server: EngineServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0)


def _chat_answer(server: EngineServer, max_tokens: int) -> openai.types.chat.ChatCompletion:
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    return chat.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens, temperature=0)


def test_a_message_is_the_chat_routes_answer(tiny_server: EngineServer, client: anthropic.Anthropic) -> None:
    args = dict(model=tiny_server.model, max_tokens=8, system=SYSTEM, extra_body=GREEDY)
    message = client.messages.create(messages=[{"role": "user", "content": QUESTION}], **args)
    chat = _chat_answer(tiny_server, 8)
    assert message.type == "message" and message.role == "assistant" and message.model == tiny_server.model
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    counted = client.messages.count_tokens(
        model=tiny_server.model, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == chat.usage.prompt_tokens
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted.input_tokens
    # Streamed: Anthropic's event order, the same text, the same final message.
    with client.messages.stream(messages=[{"role": "user", "content": QUESTION}], **args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start" and kinds[-1] == "message_stop"
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"] and "content_block_delta" in kinds
    assert final.content[0].text == message.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8
    wait_for(lambda: idle_with_every_block_free(tiny_server))


def test_stop_sequences_and_a_conversation_with_an_assistant_turn(
    tiny_server: EngineServer, client: anthropic.Anthropic
) -> None:
    free = client.messages.create(
        model=tiny_server.model, max_tokens=12, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}]
    )
    text = free.content[0].text
    stop = text[4:7]
    stopped = client.messages.create(
        model=tiny_server.model,
        max_tokens=12,
        extra_body=GREEDY,
        stop_sequences=[stop],
        messages=[{"role": "user", "content": QUESTION}],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]
    turns = [
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi."}]},
        {"role": "user", "content": "And again?"},
    ]
    assert client.messages.create(model=tiny_server.model, max_tokens=4, messages=turns).usage.output_tokens == 4


def test_refusals_come_in_anthropics_shape(tiny_server: EngineServer, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=tiny_server.model, max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert refused.value.body["type"] == "error"  # type: ignore[index]
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    no_max = httpx.post(f"{tiny_server.url}/v1/messages", json={"model": tiny_server.model, "messages": []})
    assert no_max.status_code == 400 and no_max.json()["error"]["type"] == "invalid_request_error"
    not_json = httpx.post(f"{tiny_server.url}/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and not_json.json()["type"] == "error"
