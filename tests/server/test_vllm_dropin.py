"""What vLLM's own OpenAI-server tests expect of a drop-in (issue 51): `model` optional,
vLLM's token-level keys always sent, token ids streamed whole around incomplete UTF-8,
echo's logprobs, -1 for the whole vocabulary, the server-wide flags (`--return-tokens-as-
token-ids`, `--enable-prompt-tokens-details`, `--enable-force-include-usage`,
`--enable-server-load-tracking`), vLLM's counters, `/invocations`, vLLM's error wording and
`pagefleet serve MODEL`. The default server (tiny_server) has every flag off; `flagged` has
them on, the model given first as `vllm serve MODEL` takes it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagefleet.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.processes import EngineServer, metrics, start_server, stop_server

CHAT = [{"role": "user", "content": "Tell me a story about a dragon."}]
VLLM_FLAGS = (
    "--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "8", "--max-logprobs", "-1",
    "--return-tokens-as-token-ids", "--enable-prompt-tokens-details", "--enable-force-include-usage",
    "--enable-server-load-tracking",
)  # fmt: skip


@pytest.fixture(scope="module")
def flagged(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("dropin") / "flagged.log"
    server = start_server(str(tiny_llama), log, *VLLM_FLAGS, model_first=True)
    yield server
    stop_server(server)


def _post(server: EngineServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def _events(server: EngineServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_model_is_optional_and_means_the_served_model(tiny_server: EngineServer) -> None:
    greedy = {"max_tokens": 5, "temperature": 0}
    named = _post(tiny_server, "/v1/completions", {"model": tiny_server.model, "prompt": "Once", **greedy}).json()
    for body in ({"prompt": "Once", **greedy}, {"model": None, "prompt": "Once", **greedy}):
        answer = _post(tiny_server, "/v1/completions", body)
        assert answer.status_code == 200 and answer.json()["model"] == tiny_server.model
        assert answer.json()["choices"][0]["text"] == named["choices"][0]["text"]
    chat = _post(tiny_server, "/v1/chat/completions", {"messages": CHAT, **greedy})
    assert chat.status_code == 200 and chat.json()["model"] == tiny_server.model


def test_vllms_token_level_keys_are_always_sent(tiny_server: EngineServer) -> None:
    body = {"model": tiny_server.model, "max_tokens": 3, "temperature": 0}
    choice = _post(tiny_server, "/v1/completions", {**body, "prompt": "Once"}).json()["choices"][0]
    assert {"prompt_logprobs", "prompt_token_ids", "token_ids"} <= choice.keys()
    assert choice["prompt_logprobs"] is choice["prompt_token_ids"] is choice["token_ids"] is None
    chat = _post(tiny_server, "/v1/chat/completions", {**body, "messages": CHAT}).json()
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    assert chat["choices"][0]["token_ids"] is None and chat["choices"][0]["message"]["tool_calls"] == []
    asked = _post(tiny_server, "/v1/chat/completions", {**body, "messages": CHAT, "return_token_ids": True}).json()
    assert len(asked["choices"][0]["token_ids"]) == 3 and asked["prompt_token_ids"]
    tokenized = _post(tiny_server, "/tokenize", {"prompt": "Hello"}).json()
    assert "token_strs" in tokenized and tokenized["token_strs"] is None


def test_streamed_token_ids_each_go_out_once_around_incomplete_utf8(tiny_server: EngineServer) -> None:
    """The model may only write the bytes of emoji and CJK characters, in any order: many
    of its tokens end inside a character, and their ids go out with the next chunk."""
    byte_tokens = _post(tiny_server, "/tokenize", {"prompt": "😀漢"}).json()["tokens"]
    assert len(byte_tokens) >= 5, "a token a byte or two: the tiny tokenizer merged few of these"
    body = {
        "model": tiny_server.model,
        "messages": CHAT,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "allowed_token_ids": byte_tokens,
        "return_token_ids": True,
    }
    whole = _post(tiny_server, "/v1/chat/completions", body).json()["choices"][0]["token_ids"]
    chunks = _events(tiny_server, "/v1/chat/completions", body)
    streamed = [token for chunk in chunks for choice in chunk["choices"] for token in choice.get("token_ids") or []]
    assert streamed == whole and len(whole) == 24
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == _post(tiny_server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]


def test_echo_logprobs_name_the_first_prompt_token(tiny_server: EngineServer) -> None:
    body = {"model": tiny_server.model, "prompt": "Hello there", "max_tokens": 2, "temperature": 0}
    logprobs = _post(tiny_server, "/v1/completions", {**body, "echo": True, "logprobs": 1}).json()["choices"][0][
        "logprobs"
    ]
    first_id = _post(tiny_server, "/tokenize", {"prompt": "Hello there"}).json()["tokens"][0]
    first_text = _post(tiny_server, "/detokenize", {"tokens": [first_id]}).json()["prompt"]
    assert logprobs["tokens"][0] == first_text != "" and logprobs["token_logprobs"][0] is None
    offsets, tokens = logprobs["text_offset"], logprobs["tokens"]
    assert offsets[0] == 0 and all(offsets[i + 1] == offsets[i] + len(tokens[i]) for i in range(len(tokens) - 1))


def test_minus_one_is_the_whole_vocabulary_where_max_logprobs_allows_it(
    tiny_server: EngineServer, flagged: EngineServer
) -> None:
    chat = {"messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": -1}
    refused = _post(tiny_server, "/v1/chat/completions", chat)  # --max-logprobs 20
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    for field in ({"logprobs": -1}, {"prompt_logprobs": -1}):
        answer = _post(tiny_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, **field})
        assert answer.status_code == 400, field
    whole = _post(flagged, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"][0]
    vocab = len(whole["top_logprobs"])
    assert vocab > 20 and abs(sum(2.718281828 ** e["logprob"] for e in whole["top_logprobs"]) - 1) < 1e-3
    completion = _post(flagged, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "logprobs": -1}).json()
    assert len(completion["choices"][0]["logprobs"]["top_logprobs"][0]) == vocab


def test_server_wide_token_ids_and_prompt_token_details(tiny_server: EngineServer, flagged: EngineServer) -> None:
    body = {"prompt": "one two three four five six seven eight nine ten", "max_tokens": 2, "logprobs": 1}
    named = _post(flagged, "/v1/completions", body).json()["choices"][0]["logprobs"]["tokens"]
    assert all(name.startswith("token_id:") for name in named)
    cold = _post(flagged, "/v1/completions", {**body, "prompt": "a prompt never sent before"}).json()["usage"]
    assert cold["prompt_tokens_details"] == {"cached_tokens": 0}  # as vLLM 0.32: 0 is said too
    again = _post(flagged, "/v1/completions", body).json()["usage"]  # its prompt's blocks are cached now
    assert again["prompt_tokens_details"]["cached_tokens"] >= 8
    for _ in range(2):
        off = _post(tiny_server, "/v1/completions", {**body, "model": tiny_server.model}).json()["usage"]
    assert off["prompt_tokens_details"] is None


def test_force_include_usage_sends_the_running_usage_in_every_chunk(
    tiny_server: EngineServer, flagged: EngineServer
) -> None:
    body = {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    chunks = _events(flagged, "/v1/chat/completions", body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    running = [chunk["usage"]["completion_tokens"] for chunk in chunks[:-1]]
    assert running == sorted(running) and running[-1] == 4 and all(chunk["usage"] for chunk in chunks)
    plain = _events(tiny_server, "/v1/chat/completions", {**body, "model": tiny_server.model})
    assert all(chunk.get("usage") is None for chunk in plain)


def test_load_counts_generation_requests_in_flight_when_tracked(
    tiny_server: EngineServer, flagged: EngineServer
) -> None:
    started, release = threading.Event(), threading.Event()
    loads: dict[str, int] = {}

    def stream(server: EngineServer) -> None:
        body = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            for _ in response.iter_lines():
                if not started.is_set():
                    started.set()
                    release.wait(30)

    for name, server in (("tracked", flagged), ("untracked", tiny_server)):
        started.clear(), release.clear()
        worker = threading.Thread(target=stream, args=(server,))
        worker.start()
        assert started.wait(30)
        loads[name] = httpx.get(f"{server.url}/load").json()["server_load"]
        release.set()
        worker.join(60)
        loads[name + " after"] = httpx.get(f"{server.url}/load").json()["server_load"]
    assert loads == {"tracked": 1, "tracked after": 0, "untracked": 0, "untracked after": 0}


def test_vllms_counters_and_cache_config(flagged: EngineServer) -> None:
    before = metrics(flagged)
    prompt = _post(flagged, "/tokenize", {"prompt": "alpha beta gamma delta"}).json()["count"]
    body = {"prompt": "alpha beta gamma delta", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    _post(flagged, "/v1/completions", body)
    after = metrics(flagged)

    def grew(name: str) -> float:
        return after[f"vllm:{name}{{engine=0}}"] - before[f"vllm:{name}{{engine=0}}"]

    # One observation a step: the prompt (cached part included) in its first token's step, and each sampled token.
    assert grew("iteration_tokens_total_count") == 5 and grew("iteration_tokens_total_sum") == prompt + 5
    assert grew("prompt_tokens_total") == prompt
    assert after["vllm:num_requests_waiting_by_reason{engine=0,reason=capacity}"] == 0
    assert after["vllm:num_requests_waiting_by_reason{engine=0,reason=deferred}"] == 0
    info = [name for name in after if name.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and "block_size=8" in info[0] and after[info[0]] == 1


def test_a_fresh_servers_counters_leave_out_the_warm_up(tiny_llama: Path, tmp_path: Path) -> None:
    server = start_server(str(tiny_llama), tmp_path / "fresh.log", "--num-kv-blocks", "64")
    try:
        fresh = metrics(server)
        for name in ("prompt_tokens_total", "generation_tokens_total", "iteration_tokens_total_count"):
            assert fresh[f"vllm:{name}{{engine=0}}"] == 0, name
        assert fresh["pagefleet:prompt_tokens_total"] == 0
        assert sum(v for k, v in fresh.items() if k.startswith("vllm:request_success_total")) == 0
    finally:
        stop_server(server)


def test_invocations_serve_chat_and_completions_as_their_routes(flagged: EngineServer) -> None:
    chat = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
    completion = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0}
    for body, path, read in (
        (chat, "/v1/chat/completions", lambda a: a["choices"][0]["message"]["content"]),
        (completion, "/v1/completions", lambda a: a["choices"][0]["text"]),
    ):
        via = _post(flagged, "/invocations", body)
        assert via.status_code == 200 and read(via.json()) == read(_post(flagged, path, body).json())
        assert via.json()["object"] == _post(flagged, path, body).json()["object"]
    assert _post(flagged, "/invocations", {"max_tokens": 2}).status_code == 400
    bad = _post(flagged, "/invocations", {"messages": CHAT, "max_tokens": "many"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_error_wording_as_vllms(tiny_server: EngineServer) -> None:
    for seed, rule in ((2**64, "less_than_equal"), (-(2**64), "greater_than_equal")):
        answer = _post(tiny_server, "/v1/completions", {"prompt": "Hi", "seed": seed})
        assert answer.status_code == 400 and rule in answer.json()["error"]["message"]
    for missing in ({}, {"prompt": ""}, {"prompt": []}):
        nothing = _post(tiny_server, "/v1/completions", {"max_tokens": 2, **missing})
        assert nothing.status_code == 400, missing
        assert "Either prompt or prompt_embeds must be provided and non-empty." in nothing.json()["error"]["message"]


def test_vllms_sampling_params_import_path() -> None:
    params = SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert params.structured_outputs is not None and params.structured_outputs.choice == ["a", "b"]


NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": NO_ARGUMENTS}}]


def test_streamed_chat_with_tools_streams_as_it_goes_and_agrees_with_the_whole_answer(
    tiny_server: EngineServer,
) -> None:
    """auto: the tiny model writes no call, so its text streams in many deltas; required: the
    calls streamed are the calls of the same request unstreamed."""
    hi = [{"role": "user", "content": "hi"}]  # the tools' system prompt takes most of the 512-token window
    base = {"model": tiny_server.model, "messages": hi, "temperature": 0, "tools": TOOLS}
    auto = {**base, "max_tokens": 12, "ignore_eos": True}
    whole = _post(tiny_server, "/v1/chat/completions", auto).json()["choices"][0]["message"]
    chunks = _events(tiny_server, "/v1/chat/completions", auto)
    contents = [
        c["choices"][0]["delta"]["content"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")
    ]
    assert len(contents) > 1 and "".join(contents) == whole["content"] and whole["tool_calls"] == []
    required = {**base, "max_tokens": 40, "tool_choice": "required", "parallel_tool_calls": False}
    answered = _post(tiny_server, "/v1/chat/completions", required)
    assert answered.status_code == 200, answered.text
    answer = answered.json()["choices"][0]
    streamed = _events(tiny_server, "/v1/chat/completions", required)
    calls = [d for c in streamed if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in answer["message"]["tool_calls"]
    ]
    assert answer["message"]["content"] == ""
    reasons = [c["choices"][0]["finish_reason"] for c in streamed if c["choices"] and c["choices"][0]["finish_reason"]]
    assert reasons == [answer["finish_reason"]]
