"""A small fleet for the gateway tests: Redis, two tiny engine replicas, a gateway."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.processes import (
    EngineServer,
    GatewayProcess,
    RedisProcess,
    running_redis,
    start_gateway,
    start_server,
    stop_process,
    stop_server,
)

# Dashboard samples often enough for a test to see its charts fill within seconds.
DASHBOARD_FLAGS = ("--dashboard-interval-s", "0.5", "--dashboard-window-s", "2")
# --enable-prompt-tokens-details: the replicas report cached prompt tokens, as the fleet's own
# launchers (`pagefleet up`, the operator) start them.
ENGINE_FLAGS = (
    "--dtype", "float32", "--num-kv-blocks", "200", "--block-size", "8", "--record-ttl", "1.5",
    "--enable-prompt-tokens-details",
)  # fmt: skip


def start_replica(model_dir: Path, log_dir: Path, redis: RedisProcess, replica: str, *flags: str) -> EngineServer:
    flags = ("--served-model-name", "tiny", "--replica-id", replica, "--redis-url", redis.url, *ENGINE_FLAGS, *flags)
    return start_server(str(model_dir), log_dir / f"{replica}.log", *flags)


def prefix_routing_ready(gateway_url: str) -> bool:
    """The gateway has read the model's tokenizer (it does so once the model has two replicas)."""
    return 'pagefleet_gateway:prefix_routing_ready{model="tiny"} 1.0' in httpx.get(f"{gateway_url}/metrics").text


RESPONSES_ARGS = {"model": "tiny", "instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0}
LONG_QUESTION = "Tell me about paged attention, block tables and copy on write in a few words."


def two_turns(base_url: str) -> tuple[Any, Any]:
    """A question and its follow-up through `previous_response_id`, sent to `base_url` (a
    router); the two raw answers (their headers name the replica that ran each)."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    first = client.responses.with_raw_response.create(input=LONG_QUESTION, **RESPONSES_ARGS)
    second = client.responses.with_raw_response.create(
        previous_response_id=first.parse().id, input="And again?", **RESPONSES_ARGS
    )
    return first, second


@dataclass
class Fleet:
    redis: RedisProcess
    replicas: dict[str, EngineServer]
    gateway: GatewayProcess
    logs: Path


@pytest.fixture(scope="session")
def fleet(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("fleet")
    with running_redis() as redis:
        replicas = {name: start_replica(tiny_llama, logs, redis, name) for name in ("tiny-a", "tiny-b")}
        gateway = start_gateway(redis.url, logs / "gateway.log", *DASHBOARD_FLAGS)
        yield Fleet(redis, replicas, gateway, logs)
        stop_process(gateway.process)
        for replica in replicas.values():
            stop_server(replica)
