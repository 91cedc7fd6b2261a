"""The engine server through the official `openai` client and raw HTTP: completions, chat,
streaming, n, logprobs, stop, seeds, errors, disconnects, continuous batching."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.processes import EngineServer, idle_with_every_block_free, metrics, start_server, stop_server, wait_for


@pytest.fixture(scope="module")
def client(tiny_server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


def test_models_health_version_tokenize(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [tiny_server.model]
    assert httpx.get(f"{tiny_server.url}/v1/models").json()["data"][0]["parent"] is None
    assert httpx.get(f"{tiny_server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{tiny_server.url}/version").json()["version"]
    tokens = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "Hello world"}
    strs = httpx.post(f"{tiny_server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert strs["tokens"] == tokens["tokens"] and len(strs["token_strs"]) == tokens["count"]
    assert httpx.get(f"{tiny_server.url}/load").json() == {"server_load": 0}
    chat = httpx.post(f"{tiny_server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tokens["count"] - 2
    exported = metrics(tiny_server)
    for name in ("num_shared_blocks", "num_blocks_saved_by_sharing", "cow_copies_total", "prefix_cache_hits_total"):
        assert f"pagefleet:{name}" in exported
    # The gauges stock routers (GIE's endpoint picker, vLLM's router) scrape, under vLLM's names.
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert exported[f"vllm:{name}{{engine=0}}"] == exported[f"pagefleet:{name}"]


def test_vllms_metrics_under_its_names_labels_and_buckets(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    """vLLM's dashboards and alerts read pagefleet unchanged: one request of P prompt tokens
    (none cached) and G generated ones counts once in each request histogram and the success
    counter, and its steps count P + G tokens (vLLM's iteration tokens: the prompt in the step
    of its first token, and every token sampled)."""
    before = metrics(tiny_server)
    prompt = [7, 3, 301, 44, 12, 200, 5, 77, 100, 23, 8]  # token ids no other test sends
    answer = client.completions.create(model=tiny_server.model, prompt=prompt, max_tokens=6, temperature=0.0)
    assert answer.choices[0].finish_reason == "length"
    after = metrics(tiny_server)

    def grew(name: str) -> float:
        return after[f"vllm:{name}{{engine=0}}"] - before.get(f"vllm:{name}{{engine=0}}", 0.0)

    assert after["vllm:request_success_total{engine=0,finished_reason=length}"] == 1 + before.get(
        "vllm:request_success_total{engine=0,finished_reason=length}", 0.0
    )
    for histogram in (
        "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
        "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
        "request_prompt_tokens", "request_generation_tokens", "request_params_n", "request_params_max_tokens",
    ):  # fmt: skip
        assert grew(f"{histogram}_count") == 1, histogram
    assert grew("inter_token_latency_seconds_count") == 5
    assert grew("request_prompt_tokens_sum") == len(prompt) and grew("request_generation_tokens_sum") == 6
    assert grew("iteration_tokens_total_sum") == len(prompt) + 6 and grew("iteration_tokens_total_count") == 6
    assert grew("prompt_tokens_total") == len(prompt) and grew("generation_tokens_total") == 6
    assert after["vllm:prompt_tokens_total{engine=0}"] == after["pagefleet:prompt_tokens_total"]
    assert after["vllm:prefix_cache_queries_total{engine=0}"] == after["pagefleet:prefix_cache_queries_total"]
    assert after["vllm:num_preemptions_total{engine=0}"] == sum(
        v for k, v in after.items() if k.startswith("pagefleet:num_preemptions_total")
    )
    # vLLM's buckets, to its last bound.
    assert "vllm:time_to_first_token_seconds_bucket{engine=0,le=2560.0}" in after
    assert "vllm:request_queue_time_seconds_bucket{engine=0,le=7680.0}" in after
    assert "vllm:iteration_tokens_total_bucket{engine=0,le=16384.0}" in after


def test_completion_stream_equals_non_stream(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    args = dict(model=tiny_server.model, prompt="The quick brown fox", max_tokens=12, temperature=0.0, logprobs=2)
    whole = client.completions.create(**args)
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 12 and all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    streamed_tokens = [
        t for c in chunks if c.choices for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])
    ]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert streamed_tokens == choice.logprobs.tokens, "token-level equality of stream and non-stream"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_chat_stream_order_and_usage(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    args = dict(model=tiny_server.model, messages=messages, max_tokens=10, temperature=0.0)
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_every_stream_chunk_carries_one_choice(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    """As OpenAI and vLLM frame streams: one entry per chunk, so a client reading
    `choices[0]` sees every delta and each choice's finish reason, also with n > 1."""
    model, seeded = tiny_server.model, dict(max_tokens=6, temperature=1.0, seed=5, n=2)
    messages = [{"role": "user", "content": "Hello there"}]
    for create, args, text_of in (
        (client.chat.completions.create, dict(messages=messages), lambda c: c.message.content),
        (client.completions.create, dict(prompt="Hello there"), lambda c: c.text),
    ):
        whole = create(model=model, **args, **seeded)
        chunks = [chunk for chunk in create(model=model, **args, **seeded, stream=True) if chunk.choices]
        assert all(len(chunk.choices) == 1 for chunk in chunks)
        for index in (0, 1):
            own = [chunk.choices[0] for chunk in chunks if chunk.choices[0].index == index]
            reasons = [choice.finish_reason for choice in own]
            assert reasons[-1] == whole.choices[index].finish_reason and not any(reasons[:-1])
            streamed = "".join((c.delta.content or "") if hasattr(c, "delta") else c.text for c in own)
            assert streamed == text_of(whole.choices[index]), "seeded: the stream says what the answer said"


def test_usage_while_streaming_as_vllm_reports_it(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    """`continuous_usage_stats`: every chunk carries its choice's usage so far; the last
    chunk the totals. `stream_options` without `stream` is a 400, as in vLLM."""
    model, options = tiny_server.model, {"include_usage": True, "continuous_usage_stats": True}
    messages = [{"role": "user", "content": "Hello there"}]
    for create, args in (
        (client.chat.completions.create, dict(messages=messages)),
        (client.completions.create, dict(prompt="Hello there")),
    ):
        chunks = list(create(model=model, **args, max_tokens=7, temperature=0.0, stream=True, stream_options=options))
        counts = [chunk.usage.completion_tokens for chunk in chunks[:-1]]
        assert counts == sorted(counts) and counts[-1] == 7 and chunks[-1].usage.completion_tokens == 7
        assert {chunk.usage.prompt_tokens for chunk in chunks} == {chunks[-1].usage.prompt_tokens}
        route = "chat/completions" if "messages" in args else "completions"
        body = {"model": model, **args, "stream_options": {"include_usage": True}}
        refused = httpx.post(f"{tiny_server.url}/v1/{route}", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"


def test_usage_in_streams_follows_vllms_rule() -> None:
    """Forced (`--enable-force-include-usage`): usage in every chunk and at the end, whatever
    the request says (vLLM 0.32's should_include_usage); else at the end if asked, and in
    every chunk if `continuous_usage_stats` asks too."""
    from pagefleet.engine.server.events import ChunkWriter
    from pagefleet.engine.server.settings import ServerSettings
    from pagefleet.protocol.openai import StreamOptions

    def plan(options: StreamOptions | None, force: bool) -> tuple[bool, bool]:
        settings = ServerSettings(enable_force_include_usage=force)
        writer = ChunkWriter.for_request("id", "text_completion", "m", options, settings)
        return writer.include_usage, writer.continuous_usage

    continuous = StreamOptions(include_usage=False, continuous_usage_stats=True)
    assert plan(None, False) == (False, False) and plan(None, True) == (True, True)
    assert plan(continuous, False) == (False, False) and plan(continuous, True) == (True, True)
    assert plan(StreamOptions(include_usage=True), False) == (True, False)
    assert plan(StreamOptions(include_usage=True, continuous_usage_stats=False), True) == (True, True)


def test_chat_prefill_continues_the_last_message(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    """vLLM's `continue_final_message`: the prompt ends inside the assistant's message, so
    the answer continues it (the same tokens as completing that prompt), and `echo` puts the
    message's text first. Any role the template knows is handed to it."""
    url, model, start = tiny_server.url, tiny_server.model, "The answer is"
    messages = [{"role": "user", "content": "Say it."}, {"role": "assistant", "content": start}]
    prefill = {"messages": messages, "add_generation_prompt": False}
    cut = httpx.post(f"{url}/tokenize", json={**prefill, "continue_final_message": True}).json()["tokens"]
    whole = httpx.post(f"{url}/tokenize", json=prefill).json()["tokens"]
    assert whole[: len(cut)] == cut and len(whole) > len(cut), "the end of the turn is cut off"
    greedy = dict(model=model, max_tokens=5, temperature=0.0)
    expected = client.completions.create(prompt=cut, **greedy).choices[0].text
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    answer = client.chat.completions.create(messages=messages, extra_body=extra, **greedy).choices[0].message
    assert answer.content == start + expected
    chunks = list(client.chat.completions.create(messages=messages, extra_body=extra, stream=True, **greedy))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == start + expected
    both = httpx.post(
        f"{url}/v1/chat/completions", json={"model": model, "messages": messages, "continue_final_message": True}
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    narrated = [{"role": "narrator", "content": "Once."}, {"role": "user", "content": "Go on."}]
    assert client.chat.completions.create(messages=narrated, **greedy).choices[0].message.content is not None


def test_token_level_outputs_as_vllm_returns_them(tiny_server: EngineServer) -> None:
    """`return_token_ids`: the prompt's and the answer's ids (streamed: the prompt's once,
    each chunk its own); `prompt_logprobs`: one entry per prompt position, the first None,
    each with the prompt's own token."""
    url, model = tiny_server.url, tiny_server.model
    prompt = [11, 12, 13, 14, 15, 16]
    args = {"model": model, "max_tokens": 5, "temperature": 0.0, "return_token_ids": True, "prompt_logprobs": 2}
    whole = httpx.post(f"{url}/v1/completions", json={**args, "prompt": prompt}).json()["choices"][0]
    assert whole["prompt_token_ids"] == prompt and len(whole["token_ids"]) == 5
    positions = whole["prompt_logprobs"]
    assert len(positions) == len(prompt) and positions[0] is None
    assert all(str(token) in position for token, position in zip(prompt[1:], positions[1:], strict=True))
    with httpx.stream("POST", f"{url}/v1/completions", json={**args, "prompt": prompt, "stream": True}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    choices = [event["choices"][0] for event in events if event["choices"]]
    assert choices[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]
    messages = [{"role": "user", "content": "Hello"}]
    chat = httpx.post(f"{url}/v1/chat/completions", json={**args, "messages": messages}).json()
    tokenized = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat["prompt_token_ids"] == tokenized and len(chat["choices"][0]["token_ids"]) == 5
    assert len(chat["prompt_logprobs"]) == len(tokenized)
    # `logprobs: 0`: the chosen token's logprob alone; `return_tokens_as_token_ids` names tokens by id.
    zero = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0.0, "logprobs": 0}
    logprobs = httpx.post(f"{url}/v1/completions", json=zero).json()["choices"][0]["logprobs"]
    assert [list(top) for top in logprobs["top_logprobs"]] == [[token] for token in logprobs["tokens"]]
    as_ids = httpx.post(f"{url}/v1/completions", json={**zero, "return_tokens_as_token_ids": True}).json()
    assert as_ids["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in whole["token_ids"]]
    named = {"model": model, "messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    content = httpx.post(f"{url}/v1/chat/completions", json={**named, "return_tokens_as_token_ids": True}).json()
    assert all(item["token"].startswith("token_id:") for item in content["choices"][0]["logprobs"]["content"])


def test_the_callers_request_id_names_the_response_as_vllm_does(tiny_server: EngineServer) -> None:
    """The x-request-id header (the gateway always sends one), else the body's `request_id`,
    is the response's id; two requests under one id at once still both complete."""
    url = tiny_server.url
    body = {"model": tiny_server.model, "prompt": "Hello", "max_tokens": 3, "request_id": "from-the-body"}
    assert httpx.post(f"{url}/v1/completions", json=body).json()["id"] == "cmpl-from-the-body"
    headers = {"x-request-id": "req-42"}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=headers).json()["id"] == "cmpl-req-42"
    chat = {"model": tiny_server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, headers=headers).json()["id"] == "chatcmpl-req-42"
    assert httpx.post(f"{url}/v1/chat/completions", json=chat).json()["id"].startswith("chatcmpl-")
    several = {"model": tiny_server.model, "prompt": ["a", "b"], "max_tokens": 8}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=several, headers=headers), range(3)))
    assert [answer.status_code for answer in answers] == [200] * 3
    assert all(len(answer.json()["choices"]) == 2 for answer in answers)
    wait_for(lambda: idle_with_every_block_free(tiny_server))


def test_n_seed_stop_and_chat_logprobs(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    model = tiny_server.model
    sampled = dict(model=model, prompt="Paris is", max_tokens=8, temperature=1.0, seed=11, n=2)
    first = client.completions.create(**sampled)
    again = client.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices], "seeded sampling reproduces"
    greedy = client.completions.create(model=model, prompt="Paris is", max_tokens=8, temperature=0.0)
    text = greedy.choices[0].text
    stop = text[3:6]
    stopped = client.completions.create(model=model, prompt="Paris is", max_tokens=8, temperature=0.0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == text[: text.index(stop)]
    # Streamed, no chunk sends text that the stop string then takes away.
    streamed = client.completions.create(
        model=model, prompt="Paris is", max_tokens=8, temperature=0.0, stop=[stop], stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == stopped.choices[0].text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(item.top_logprobs) == 3 for item in content)
    assert all(item.top_logprobs[0].logprob >= item.logprob for item in content)


def test_concurrent_streams_are_batched(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    """16 streams at once run together (continuous batching through HTTP), and every block
    comes back afterwards. The streams start together and are long enough (160 steps) that a
    loaded machine's slow client threads and metric polls still see them overlap."""
    most_running = 0
    stop = threading.Event()
    start_together = threading.Barrier(16)

    def watch() -> None:
        nonlocal most_running
        while not stop.is_set():
            most_running = max(most_running, int(metrics(tiny_server)["pagefleet:num_requests_running"]))

    def stream(index: int) -> str:
        start_together.wait()
        chunks = client.completions.create(
            model=tiny_server.model,
            prompt=f"Request {index}:",
            max_tokens=160,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(stream, range(16)))
    stop.set()
    watcher.join()
    assert all(texts)
    assert most_running >= 8, f"at most {most_running} requests ran together"
    wait_for(lambda: idle_with_every_block_free(tiny_server))


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
        ({"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p"),
        ({"prompt": "hi", "n": 0}, 400, "n", "n"),
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ({"prompt": ""}, 400, "prompt", "empty"),
        ({"prompt": "hi " * 600}, 400, "prompt", "context window of 512 tokens"),
        ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
        ({}, 400, "prompt", "prompt"),
        ({"prompt": "hi", "model": "no-such-model"}, 404, "model", "no-such-model"),
        ({"prompt": "hi", "use_beam_search": True, "n": 2, "top_p": 0.5}, 400, "top_p", "beam search"),
        ({"prompt": "hi", "logit_bias": {"12": 101}}, 400, "logit_bias", "[-100, 100]"),
        ({"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
        ({"prompt": "hi", "allowed_token_ids": [10**6]}, 400, "allowed_token_ids", "1000000 is out of vocabulary"),
        ({"prompt": "hi", "logit_bias": {"1000001": 5}}, 400, "logit_bias", "1000001 is out of vocabulary"),
        ({"prompt": [5, 10**6]}, 400, "prompt", "1000000 is out of vocabulary"),
        ({"prompt": "hi", "bad_words": "one"}, 400, "bad_words", "bad_words"),
        ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ],
)
def test_errors_are_openai_shaped(tiny_server: EngineServer, body: dict, status: int, param: str, message: str) -> None:
    response = httpx.post(f"{tiny_server.url}/v1/completions", json={"model": tiny_server.model, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and message in error["message"]


def test_prompt_too_long_says_both_lengths(tiny_server: EngineServer) -> None:
    response = httpx.post(
        f"{tiny_server.url}/v1/completions", json={"model": tiny_server.model, "prompt": list(range(1, 301)) * 2}
    )
    assert response.status_code == 400
    assert "600 tokens" in response.json()["error"]["message"] and "512" in response.json()["error"]["message"]


def test_malformed_and_oversized_bodies(tiny_server: EngineServer) -> None:
    broken = httpx.post(
        f"{tiny_server.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    huge = httpx.post(f"{tiny_server.url}/v1/completions", json={"model": tiny_server.model, "prompt": "x" * (2 << 20)})
    assert huge.status_code == 413 and "exceeds" in huge.json()["error"]["message"]
    no_messages = httpx.post(
        f"{tiny_server.url}/v1/chat/completions", json={"model": tiny_server.model, "messages": []}
    )
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    chat = {"model": tiny_server.model, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    too_many = httpx.post(f"{tiny_server.url}/v1/chat/completions", json={**chat, "top_logprobs": 21})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "top_logprobs"


def test_api_keys_then_a_full_queue_answers_503_with_retry_after(tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM's --api-key guards the /v1 routes only (probes and Prometheus need no key),
    under --root-path with the prefix or without it (a proxy that strips it); a request past
    it finds the queue full (--max-waiting-requests 0)."""
    flags = ("--max-waiting-requests", "0", "--num-kv-blocks", "64", "--api-key", "key-one", "key-two")
    server = start_server(str(tiny_llama), tmp_path / "full.log", *flags, "--root-path", "/serving")
    try:
        body = {"model": server.model, "prompt": "hi"}
        for headers in ({}, {"Authorization": "Bearer key-three"}, {"Authorization": "key-one"}):
            for path in ("/v1/completions", "/serving/v1/completions", "//v1/completions", "/serving//v1/completions"):
                refused = httpx.post(f"{server.url}{path}", json=body, headers=headers)
                assert refused.status_code == 401 and refused.json()["error"]["code"] == 401, (path, headers)
        for path in ("/v1/models", "/serving/v1/models"):
            assert httpx.get(f"{server.url}{path}").status_code == 401, path
            assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Bearer key-one"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="key-two", max_retries=0)
        assert [m.id for m in client.models.list().data] == [server.model]
        for open_path in ("/health", "/metrics", "/load", "/version"):
            assert httpx.get(f"{server.url}{open_path}").status_code == 200, open_path
        response = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer key-one"})
        assert response.status_code == 503 and response.headers["retry-after"]
        assert response.json()["error"]["type"] == "service_unavailable"
    finally:
        stop_server(server)


def test_several_prompts_echo_and_beam_search(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    model = tiny_server.model
    greedy = dict(model=model, max_tokens=6, temperature=0.0)
    alone = [client.completions.create(prompt=p, **greedy).choices[0].text for p in ("One", "Two three")]
    both = client.completions.create(prompt=["One", "Two three"], n=2, **greedy)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    streamed = list(client.completions.create(prompt=["One", "Two three"], stream=True, **greedy))
    for index, expected in enumerate(alone):
        assert "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == index) == expected
    echoed = client.completions.create(prompt="One", echo=True, **greedy)
    assert echoed.choices[0].text == "One" + alone[0]
    beams = client.completions.create(
        prompt="One", n=2, best_of=3, extra_body={"use_beam_search": True, "ignore_eos": True}, **greedy
    )
    assert len(beams.choices) == 2 and beams.choices[0].text != beams.choices[1].text


def test_token_constraints_and_vllm_fields_on_both_routes(tiny_server: EngineServer, client: openai.OpenAI) -> None:
    """logit_bias (OpenAI's), allowed_token_ids, truncate_prompt_tokens and the rest of
    vLLM's extra fields, through the official client's extra_body."""
    allowed = [7, 11, 13]
    completion = client.completions.create(
        model=tiny_server.model,
        prompt=[1, 2, 3, 4, 5, 6, 7, 8],
        max_tokens=6,
        temperature=0,
        logprobs=0,
        user="someone",
        extra_body={"allowed_token_ids": allowed, "truncate_prompt_tokens": 4, "ignore_eos": True},
    )
    assert completion.usage is not None and completion.usage.prompt_tokens == 4
    tokens = completion.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert len(tokens) == 6
    forced = client.chat.completions.create(
        model=tiny_server.model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        logit_bias={"42": 100},
        extra_body={"ignore_eos": True, "skip_special_tokens": False, "spaces_between_special_tokens": True},
    )
    token_42 = httpx.post(f"{tiny_server.url}/detokenize", json={"model": tiny_server.model, "tokens": [42]}).json()
    chosen = [item.token for item in forced.choices[0].logprobs.content]  # type: ignore[union-attr]
    assert chosen == [token_42["prompt"]] * 3


def test_token_ids_only_and_a_higher_logprobs_ceiling(tiny_llama: Path, tmp_path: Path) -> None:
    """vLLM's `--skip-tokenizer-init` (token ids in, token ids out; text is refused clearly)
    and `--max-logprobs` (the ceiling moves, and the error names it); vLLM's
    `--no-enable-tokenizer-info-endpoint` takes the route away."""
    flags = ("--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "8", "--skip-tokenizer-init")
    server = start_server(str(tiny_llama), tmp_path / "ids.log", *flags, "--max-logprobs", "30",
                          "--no-enable-tokenizer-info-endpoint")  # fmt: skip
    try:
        body = {"model": server.model, "prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0}
        answer = httpx.post(
            f"{server.url}/v1/completions",
            json={**body, "logprobs": 25, "return_token_ids": True},
        )
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert len(choice["token_ids"]) == 5 and choice["text"] == ""
        assert all(len(top) == 25 for top in choice["logprobs"]["top_logprobs"])  # named by id: none collide
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        too_many = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 31})
        assert too_many.status_code == 400 and "greater than max allowed: 30" in too_many.json()["error"]["message"]
        text = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "Hello"})
        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": server.model, "messages": [{"role": "user", "content": "hi"}]},
        )
        for refused in (text, chat):
            assert refused.status_code == 400 and "tokenizer" in refused.json()["error"]["message"]
        assert httpx.get(f"{server.url}/tokenizer_info").status_code == 404
    finally:
        stop_server(server)


def test_a_batch_of_conversations_is_each_conversations_answer(
    tiny_server: EngineServer, client: openai.OpenAI
) -> None:
    """vLLM's /v1/chat/completions/batch: one choice per conversation, in order, each the
    answer the chat route gives that conversation alone; a bad conversation refuses the
    whole batch and leaves no block held."""
    conversations = [[{"role": "user", "content": "Hello there"}], [{"role": "user", "content": "Another one"}]]
    url = f"{tiny_server.url}/v1/chat/completions/batch"
    body = {"model": tiny_server.model, "messages": conversations, "max_tokens": 5, "temperature": 0}
    answer = httpx.post(url, json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert [choice["index"] for choice in choices] == [0, 1]
    for choice, messages in zip(choices, conversations, strict=True):
        alone = client.chat.completions.create(model=tiny_server.model, messages=messages, max_tokens=5, temperature=0)
        assert choice["message"]["content"] == alone.choices[0].message.content
    assert answer.json()["usage"]["completion_tokens"] == 10
    assert httpx.post(url, json={**body, "stream": True}).status_code == 400
    assert httpx.post(url, json={**body, "messages": [conversations[0], []]}).status_code == 400
    too_long = [{"role": "user", "content": "word " * 600}]
    refused = httpx.post(url, json={**body, "messages": [conversations[0], too_long]}, timeout=60)
    assert refused.status_code == 400
    wait_for(lambda: idle_with_every_block_free(tiny_server))
