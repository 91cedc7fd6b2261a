"""Prefill/decode disaggregation through the gateway: one prefill replica, one decode
replica, the prompt's KV pulled over HTTP between them, and the client sees one ordinary
answer, token for token the one a colocated replica gives.

All replicas are real `pagefleet serve` processes of one tiny random Llama; the colocated
reference replica is not in Redis, so the gateway never routes to it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.envoy import render_config, start_envoy, start_picker
from tests.processes import (
    EngineServer,
    GatewayProcess,
    RedisProcess,
    free_port,
    idle_with_every_block_free,
    metrics,
    running_redis,
    start_gateway,
    start_server,
    stop_process,
    stop_server,
    wait_for,
)

BLOCK_SIZE = 16
PIN_TIMEOUT_S = 3
FLAGS = ("--served-model-name", "tiny", "--dtype", "float32", "--num-kv-blocks", "200", "--block-size", "16")


@dataclass
class PDFleet:
    redis: RedisProcess
    prefill: EngineServer
    decode: EngineServer
    colocated: EngineServer  # the reference: not in Redis
    gateway: GatewayProcess
    logs: Path


def _replica(model: Path, logs: Path, redis: RedisProcess | None, name: str, *flags: str) -> EngineServer:
    registered = ("--redis-url", redis.url, "--replica-id", name, "--record-ttl", "1.5") if redis else ()
    return start_server(str(model), logs / f"{name}.log", *FLAGS, *registered, *flags)


@pytest.fixture(scope="module")
def pd(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDFleet]:
    logs = tmp_path_factory.mktemp("pd")
    with running_redis() as redis:
        prefill = _replica(tiny_llama, logs, redis, "prefill-0", "--role", "prefill", "--kv-pin-timeout", "3")
        decode = _replica(tiny_llama, logs, redis, "decode-0", "--role", "decode")
        colocated = _replica(tiny_llama, logs, None, "colocated")
        gateway = start_gateway(redis.url, logs / "gateway.log")
        wait_for(lambda: len(httpx.get(f"{gateway.url}/v1/models").json()["data"]) == 1, timeout=10)
        yield PDFleet(redis, prefill, decode, colocated, gateway, logs)
        stop_process(gateway.process)
        for replica in (prefill, decode, colocated):
            stop_server(replica)


def _prompt(length: int) -> list[int]:
    return [(7 * i + 3) % 250 + 1 for i in range(length)]


def _complete(url: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _texts(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]


def _transferred(server: EngineServer, direction: str) -> float:
    return metrics(server).get(f"pagefleet:kv_transfer_blocks_total{{direction={direction}}}", 0.0)


def _all_idle(pd: PDFleet) -> None:
    """Nothing pinned, running or held on either side: no block leaked."""
    wait_for(lambda: idle_with_every_block_free(pd.prefill) and idle_with_every_block_free(pd.decode), timeout=10)
    assert metrics(pd.prefill)["pagefleet:kv_pinned_blocks"] == 0


@pytest.mark.parametrize("length", [1, 15, 16, 17, 300])
def test_greedy_output_equals_a_colocated_replica_at_block_boundaries(pd: PDFleet, length: int) -> None:
    body = {"model": "tiny", "prompt": _prompt(length), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    sent_before = _transferred(pd.prefill, "sent")
    answer = _complete(pd.gateway.url, body)
    assert _texts(answer) == _texts(_complete(pd.colocated.url, body))
    assert answer.headers["x-pagefleet-prefill-replica"] == "prefill-0"
    assert answer.headers["x-pagefleet-replica"] == "decode-0"
    assert answer.json()["usage"]["prompt_tokens"] == length
    # All but the last prompt token come from the prefill replica, in whole blocks.
    assert _transferred(pd.prefill, "sent") - sent_before == math.ceil((length - 1) / BLOCK_SIZE)
    _all_idle(pd)


def test_n2_and_streaming_equal_the_colocated_output(pd: PDFleet) -> None:
    body = {"model": "tiny", "prompt": _prompt(40), "max_tokens": 10, "temperature": 0, "n": 2, "ignore_eos": True}
    expected = _texts(_complete(pd.colocated.url, body))
    assert _texts(_complete(pd.gateway.url, body)) == expected
    streamed: dict[int, str] = {0: "", 1: ""}
    with httpx.stream("POST", f"{pd.gateway.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed[choice["index"]] += choice["text"]
    assert [streamed[0], streamed[1]] == expected
    _all_idle(pd)


def test_chat_through_the_pair_equals_the_colocated_replica(pd: PDFleet) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me about paged attention and KV blocks."}],
        "max_tokens": 12,
        "temperature": 0,
    }
    paired = httpx.post(f"{pd.gateway.url}/v1/chat/completions", json=body, timeout=60)
    alone = httpx.post(f"{pd.colocated.url}/v1/chat/completions", json=body, timeout=60)
    assert paired.status_code == 200, paired.text
    assert paired.json()["choices"][0]["message"] == alone.json()["choices"][0]["message"]
    assert "x-pagefleet-prefill-replica" in paired.headers
    _all_idle(pd)


def test_a_prefill_answer_names_its_blocks_and_the_timeout_frees_them_unpulled(pd: PDFleet) -> None:
    body = {"model": "tiny", "prompt": _prompt(40), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    answer = _complete(pd.prefill.url, body)
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert len(params["remote_block_ids"]) == math.ceil(40 / BLOCK_SIZE)
    assert params["remote_engine_id"] == "prefill-0"
    assert f"http://{params['remote_host']}:{params['remote_port']}" == pd.prefill.url
    assert metrics(pd.prefill)["pagefleet:kv_pinned_blocks"] == 3
    timeouts = metrics(pd.prefill)["pagefleet:kv_pin_timeouts_total"]
    wait_for(lambda: metrics(pd.prefill)["pagefleet:kv_pinned_blocks"] == 0, timeout=PIN_TIMEOUT_S + 5)
    assert metrics(pd.prefill)["pagefleet:kv_pin_timeouts_total"] == timeouts + 1
    # A decode replica that comes too late gets a clear error, not garbage.
    late = _complete(pd.decode.url, {**body, "max_tokens": 5, "kv_transfer_params": params})
    assert late.status_code == 502
    assert "timed out" in late.json()["error"]["message"]
    _all_idle(pd)


def test_roles_refuse_the_other_half(pd: PDFleet) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}}
    refused = _complete(pd.decode.url, body)
    assert refused.status_code == 400
    assert "--role decode" in refused.json()["error"]["message"]
    incomplete = _complete(pd.decode.url, {**body, "kv_transfer_params": {"do_remote_prefill": True}})
    assert incomplete.status_code == 400
    assert "remote_block_ids" in incomplete.json()["error"]["message"]


def test_mismatched_block_sizes_are_refused_with_a_clear_error(pd: PDFleet) -> None:
    other = _replica(Path(pd.colocated.model), pd.logs, None, "decode-32", "--role", "decode", "--block-size", "32")
    try:
        body = {
            "model": "tiny",
            "prompt": _prompt(40),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        params = _complete(pd.prefill.url, body).json()["kv_transfer_params"]
        refused = _complete(other.url, {**body, "max_tokens": 5, "kv_transfer_params": params})
        assert refused.status_code == 502
        message = refused.json()["error"]["message"]
        assert "block_size" in message and "32" in message and "16" in message, message
        assert idle_with_every_block_free(other)
        # Nothing was sent: the blocks stay pinned for a decode replica that fits.
        good = _complete(pd.decode.url, {**body, "max_tokens": 5, "kv_transfer_params": params})
        assert good.status_code == 200, good.text
    finally:
        stop_server(other)
    _all_idle(pd)


def test_vllm_router_drives_the_pair(pd: PDFleet) -> None:
    """vLLM's own router in its P/D mode (`kv_transfer_params` flow, NIXL-style pull)."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
    from peers import vllm_router_binary  # type: ignore[import-not-found]

    try:
        router = vllm_router_binary()
    except subprocess.CalledProcessError as error:
        pytest.skip(f"vllm-router cannot be installed here: {error}")
    port = free_port()
    command = [str(router), "--vllm-pd-disaggregation", "--prefill", pd.prefill.url, "--decode", pd.decode.url]
    with open(pd.logs / "vllm-router.log", "wb") as log:
        process = subprocess.Popen(
            [*command, "--port", str(port), "--policy", "round_robin"], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _reachable(url), timeout=30)
        body = {"model": "tiny", "prompt": _prompt(40), "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        sent_before = _transferred(pd.prefill, "sent")
        assert _texts(_complete(url, body)) == _texts(_complete(pd.colocated.url, body))
        assert _transferred(pd.prefill, "sent") - sent_before == 3
    finally:
        stop_process(process)
    _all_idle(pd)


def _reachable(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code < 500
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("body_mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_envoy_with_the_picker_pairs_prefill_and_decode(pd: PDFleet, tmp_path: Path, body_mode: str) -> None:
    """The picker runs the prompt on the prefill replica itself, then has Envoy send the
    request, its body grown by the `kv_transfer_params`, to the decode replica."""
    picker = start_picker(pd.redis.url, tmp_path / "picker.log")
    picker_port = int(picker.address.split(":")[1])
    fallback = int(pd.decode.url.rsplit(":", 1)[1])
    envoy = start_envoy(render_config(picker_port, fallback, free_port(), free_port(), body_mode=body_mode), tmp_path)
    try:
        body = {"model": "tiny", "prompt": _prompt(40), "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        sent_before = _transferred(pd.prefill, "sent")
        answer = _complete(envoy.url, body)
        assert _texts(answer) == _texts(_complete(pd.colocated.url, body))
        assert answer.headers["x-pagefleet-prefill-replica"] == "prefill-0"
        assert answer.headers["x-pagefleet-replica"] == "decode-0"
        assert _transferred(pd.prefill, "sent") - sent_before == 3
        streamed = ""
        with httpx.stream("POST", f"{envoy.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert [streamed] == _texts(answer)
    finally:
        stop_process(envoy.process)
        stop_process(picker.process)
    _all_idle(pd)


def test_a_prefill_replica_killed_mid_request_leaves_complete_answers_or_clean_errors(pd: PDFleet) -> None:
    """Runs last: it kills the fleet's prefill replica. Every client gets the colocated
    answer (from the decode replica running it whole) or an OpenAI error before any byte;
    none hangs, and the decode replica holds no block afterwards."""
    body = {"model": "tiny", "prompt": _prompt(300), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    expected = _texts(_complete(pd.colocated.url, body))
    results: list[httpx.Response | Exception] = []

    def call() -> None:
        try:
            results.append(_complete(pd.gateway.url, body))
        except httpx.HTTPError as error:  # a hang would be a ReadTimeout
            results.append(error)

    threads = [threading.Thread(target=call) for _ in range(6)]
    for thread in threads:
        thread.start()
        time.sleep(0.02)
    pd.prefill.kill()
    for thread in threads:
        thread.join(timeout=90)
    assert len(results) == 6
    for result in results:
        assert isinstance(result, httpx.Response), result
        if result.status_code == 200:
            assert _texts(result) == expected
        else:
            assert result.status_code >= 400 and "error" in result.json(), result.text
    after = _complete(pd.gateway.url, body)
    assert _texts(after) == expected
    wait_for(lambda: idle_with_every_block_free(pd.decode), timeout=10)
