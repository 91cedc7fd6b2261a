"""Simulated replicas (engine/sim): the real server, scheduler, KV cache and Redis
publication over a cost model. Three of them come from one `pagefleet sim-fleet` (two host
processes), behind a real gateway and a real Redis."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.front.llm_engine import LLMEngine
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.sim.cost_model import ChunkShape, step_seconds
from pagefleet.engine.sim.profiles import PROFILES
from pagefleet.protocol.prefix_index import blocks_key, events_key
from pagefleet.protocol.replica import ReplicaRecord, record_key
from tests.processes import (
    EngineServer,
    GatewayProcess,
    RedisProcess,
    free_port,
    metrics,
    running_redis,
    start_gateway,
    stop_process,
    wait_for,
    wait_ready,
)

MODEL = "sim-smollm2"
NUM_KV_BLOCKS = 64  # 1,024 token slots: a few long prompts evict the first
SYSTEM = "You answer questions about routing in one short sentence, and never more. " * 6


@dataclass
class SimFleet:
    redis: RedisProcess
    urls: dict[str, str]  # replica id -> URL
    gateway: GatewayProcess
    process: subprocess.Popen[bytes]


def _replica_id(port: int) -> str:
    return f"sim-cpu-smollm2-{port}"


@pytest.fixture(scope="module")
def sim_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    logs = tmp_path_factory.mktemp("sim-fleet")
    base = free_port()
    ports = [base, base + 1, base + 2]
    with running_redis() as redis_server:
        command = [sys.executable, "-m", "pagefleet.cli.main", "sim-fleet", "--replicas", "3", "--processes", "2"]
        command += ["--profile", "cpu-smollm2", "--base-port", str(base), "--redis-url", redis_server.url]
        command += ["--served-model-name", MODEL, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--record-ttl", "1.5"]
        command += ["--enable-prompt-tokens-details"]
        log = logs / "sim-fleet.log"
        with open(log, "wb") as output:
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            wait_ready("pagefleet sim-fleet", process, log, lambda: b"sim fleet ready" in log.read_bytes(), 180)
            gateway = start_gateway(redis_server.url, logs / "gateway.log")
            wait_for(lambda: f'prefix_routing_ready{{model="{MODEL}"}} 1.0' in httpx.get(f"{gateway.url}/metrics").text)
            urls = {_replica_id(port): f"http://127.0.0.1:{port}" for port in ports}
            yield SimFleet(redis_server, urls, gateway, process)
            stop_process(gateway.process)
        finally:
            stop_process(process)


def test_a_step_costs_what_the_profile_says() -> None:
    """The cost model's formula on the gpu-8b profile: a decode step is bound by reading the
    weights, a long prefill by the linear layers, and attention grows with the context."""
    gpu = PROFILES["gpu-8b"]
    decode = step_seconds(gpu, [ChunkShape(0, 1)])
    assert decode == pytest.approx(gpu.step_overhead_s + gpu.weights_read_s + gpu.kv_read_s + gpu.attention_pair_s)
    assert 0.005 < decode < 0.012  # a Llama-3-8B decode step on one H100 takes 5-12 ms
    prefill = step_seconds(gpu, [ChunkShape(0, 6000)])
    assert 6000 / prefill == pytest.approx(24_000, rel=0.2)  # prompt tokens/s
    long_context = step_seconds(gpu, [ChunkShape(100_000, 1)]) - decode
    assert long_context == pytest.approx(100_000 * (gpu.kv_read_s + gpu.attention_pair_s), rel=1e-6)
    assert step_seconds(gpu, []) == 0.0


def test_the_engine_sleeps_each_step_for_its_modelled_time_stretched_by_the_time_scale() -> None:
    """The real scheduler over the cost model: each step of the runner takes the profile's
    time of the chunks the scheduler gave it, times the scale (and little more)."""
    scale = 2.0
    engine = LLMEngine(EngineConfig(simulate="cpu-smollm2", time_scale=scale, num_kv_blocks=64))
    steps: list[tuple[float, float]] = []  # (modelled, wall) of each step
    execute = engine.runner.execute

    def timed(plan):  # type: ignore[no-untyped-def]
        started = time.monotonic()
        results = execute(plan)
        modelled = step_seconds(engine.runner.profile, [ChunkShape(c.start, c.num_new_tokens) for c in plan.chunks])
        steps.append((modelled, time.monotonic() - started))
        return results

    engine.runner.execute = timed  # type: ignore[method-assign]
    engine.add_request("long", "word " * 120, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("short", "hi", SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(steps) == 4  # both prompts in the first step, then three decode steps of two
    assert engine.runner.modelled_s == pytest.approx(sum(modelled for modelled, _ in steps))
    assert steps[0][0] > 10 * steps[1][0]  # the 120-token prefill dwarfs a decode step
    for modelled, wall in steps:
        assert scale * modelled <= wall < scale * modelled + 0.05


def test_what_a_cost_model_cannot_answer_is_refused_by_name() -> None:
    with pytest.raises(InvalidParameterError, match="kv_role"):
        EngineConfig(simulate="gpu-8b", kv_role="prefill")
    with pytest.raises(InvalidParameterError, match="no profile 'tpu'.*gpu-8b"):
        EngineConfig(simulate="tpu")
    with pytest.raises(InvalidParameterError, match="time_scale"):
        EngineConfig(simulate="gpu-8b", time_scale=0)
    engine = LLMEngine(EngineConfig(simulate="gpu-8b"))
    for params in (SamplingParams(logprobs=2), SamplingParams(use_beam_search=True, beam_width=2)):
        with pytest.raises(InvalidParameterError, match="simulated replica"):
            engine.add_request("r", "hello", params)
    assert not engine.has_unfinished_requests()


def test_a_simulated_replica_answers_the_openai_routes_in_shape(sim_fleet: SimFleet) -> None:
    url = next(iter(sim_fleet.urls.values()))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is affinity?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert first.choices[0].finish_reason == "length" and first.usage is not None
    assert first.usage.completion_tokens == 8 and first.choices[0].message.content
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
    assert again.choices[0].message.content == first.choices[0].message.content  # its prompt decides its tokens
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens // 16 * 16 or cached == (again.usage.prompt_tokens - 1) // 16 * 16
    stream = client.completions.create(
        model=MODEL, prompt="Tell me", max_tokens=200, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 129  # 128 words, then EOS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=2)
    assert refused.value.body["param"] == "logprobs"  # type: ignore[index]


def test_a_simulated_replica_publishes_its_record_and_kv_events(sim_fleet: SimFleet) -> None:
    client = redis.Redis.from_url(sim_fleet.redis.url)
    replica_id, url = list(sim_fleet.urls.items())[1]
    record = ReplicaRecord.model_validate_json(client.get(record_key(MODEL, replica_id)))  # type: ignore[arg-type]
    assert record.total_blocks == NUM_KV_BLOCKS and record.block_size == 16
    events_before = client.xlen(events_key(MODEL))
    prompt = f"A prompt only this test sends, {replica_id}: " + "and its words fill blocks. " * 20
    answer = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=30)
    assert answer.status_code == 200
    full_blocks = answer.json()["usage"]["prompt_tokens"] // 16
    wait_for(lambda: client.scard(blocks_key(MODEL, replica_id)) >= full_blocks, timeout=5)
    wait_for(lambda: client.xlen(events_key(MODEL)) > events_before, timeout=5)
    assert metrics(EngineServer(url, MODEL, sim_fleet.process, Path()))["vllm:prefix_cache_queries_total{engine=0}"] > 0


def _chat(url: str, system: str, question: str) -> httpx.Response:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_behind_the_gateway_a_system_prompt_stays_where_it_is_cached_until_a_burst_spills(sim_fleet: SimFleet) -> None:
    """Affinity, then spill: the same system prompt follows its first replica while that
    replica keeps up; a burst of long questions outweighs what its cache saves and moves on."""
    gateway = sim_fleet.gateway.url
    system = "A system prompt of its own, about the Kuiper belt, long enough to fill blocks. " * 4
    first = _chat(gateway, system, "Where is it?")
    holder = first.headers["x-pagefleet-replica"]
    time.sleep(1.0)  # its blocks reach the gateway's index (published every 0.5 s)
    followers = [_chat(gateway, system, f"Question {n}?").headers["x-pagefleet-replica"] for n in range(4)]
    assert followers == [holder] * 4

    def burst(n: int) -> str:
        answer = _chat(gateway, system, f"Object {n}: " + "what is its orbit, its size and its composition? " * 6)
        assert answer.status_code == 200
        return answer.headers["x-pagefleet-replica"]

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        served = list(pool.map(burst, range(24)))
    assert holder in served and len(set(served)) > 1, served
    assert 'reason="saturated"' in httpx.get(f"{gateway}/metrics").text
