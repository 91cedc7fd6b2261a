"""LoRA adapters as models through the gateway: two replicas of one tiny base model, an
adapter on one of them; requests follow the adapter as it is loaded and unloaded, and one
that no replica serves any more is loaded again where the policy says."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.engine.test_lora import _adapter_dirs
from tests.envoy import front_door
from tests.processes import (
    EngineServer,
    GatewayProcess,
    RedisProcess,
    running_redis,
    start_gateway,
    start_server,
    stop_process,
    stop_server,
    wait_for,
)

LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
FLAGS = ("--served-model-name", "tiny", "--dtype", "float32", "--num-kv-blocks", "200", "--record-ttl", "1.5")


@dataclass
class LoRAFleet:
    redis: RedisProcess
    a: EngineServer
    b: EngineServer
    gateway: GatewayProcess
    adapters: list[Path]


@pytest.fixture(scope="module")
def fleet(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoRAFleet]:
    logs = tmp_path_factory.mktemp("lora-fleet")
    adapters = _adapter_dirs(tiny_llama, "llama")
    with running_redis() as redis:
        common = (*FLAGS, "--redis-url", redis.url, *LORA)
        a = start_server(
            str(tiny_llama), logs / "a.log", *common, "--replica-id", "a", "--lora-modules", f"first={adapters[0]}"
        )
        b = start_server(str(tiny_llama), logs / "b.log", *common, "--replica-id", "b")
        gateway = start_gateway(redis.url, logs / "gateway.log")
        yield LoRAFleet(redis, a, b, gateway, adapters)
        stop_process(gateway.process)
        for server in (a, b):
            stop_server(server)


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": [5, 9, 13, 2, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def _serves(url: str, adapter: str) -> bool:
    return adapter in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}


def _gateway_routes(fleet: LoRAFleet, adapter: str) -> set[str]:
    """The replicas the gateway would send `adapter`'s requests to."""
    for model in httpx.get(f"{fleet.gateway.url}/dashboard/data").json()["models"]:
        if model["name"] == adapter:
            return {replica["replica_id"] for replica in model["replicas"]}
    return set()


def test_the_replica_lists_its_adapters_with_their_parent(fleet: LoRAFleet) -> None:
    models = {m["id"]: m for m in httpx.get(f"{fleet.a.url}/v1/models").json()["data"]}
    assert models["first"]["parent"] == "tiny" and models["first"]["root"] == str(fleet.adapters[0])
    answer = _complete(fleet.a.url, "first")
    assert answer.status_code == 200 and answer.json()["model"] == "first"
    assert answer.json()["choices"][0]["text"] != _complete(fleet.a.url, "tiny").json()["choices"][0]["text"]
    refused = _complete(fleet.b.url, "first")
    assert refused.status_code == 404 and "`tiny`" in refused.json()["error"]["message"]


def test_runtime_load_and_unload_answer_as_vllm_does(fleet: LoRAFleet, tmp_path: Path) -> None:
    load = {"lora_name": "second", "lora_path": str(fleet.adapters[1])}
    added = httpx.post(f"{fleet.b.url}/v1/load_lora_adapter", json=load)
    assert added.status_code == 200 and "added successfully" in added.text
    before = _complete(fleet.b.url, "second").json()["choices"][0]["text"]
    again = httpx.post(f"{fleet.b.url}/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    missing = httpx.post(f"{fleet.b.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert missing.status_code == 404 and "/nowhere" in missing.json()["error"]["message"]
    # Each refusal in vLLM's words (clients match them); none breaks the adapter already served.
    config = json.loads((fleet.adapters[0] / "adapter_config.json").read_text())
    for change, phrase in (
        ({"r": 16}, "is greater than max_lora_rank"),
        ({"use_dora": True}, "does not yet support DoRA"),
        ({"modules_to_save": ["lm_head"]}, "only supports modules_to_save being None"),
        ({"r": "sixteen"}, "adapter_config.json"),
    ):
        bad = tmp_path / phrase.replace(" ", "-")
        shutil.copytree(fleet.adapters[0], bad)
        (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
        refused = httpx.post(f"{fleet.b.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(bad)})
        assert refused.status_code == 400 and phrase in refused.json()["error"]["message"], refused.text
    assert _complete(fleet.b.url, "second").json()["choices"][0]["text"] == before
    assert not _serves(fleet.b.url, "bad")
    removed = httpx.post(f"{fleet.b.url}/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert removed.status_code == 200 and "removed successfully" in removed.text
    gone = httpx.post(f"{fleet.b.url}/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert gone.status_code == 404


def test_requests_follow_the_adapter_from_replica_to_replica(fleet: LoRAFleet) -> None:
    wait_for(lambda: _gateway_routes(fleet, "first") == {"a"}, timeout=10)
    expected = _complete(fleet.a.url, "first").json()["choices"][0]["text"]
    for _ in range(6):  # b has more free blocks, but only a serves the adapter
        answer = _complete(fleet.gateway.url, "first")
        assert answer.headers["x-pagefleet-replica"] == "a"
        assert answer.json()["choices"][0]["text"] == expected
    assert {m["id"]: m for m in httpx.get(f"{fleet.gateway.url}/v1/models").json()["data"]}["first"]["parent"] == "tiny"
    load = {"lora_name": "first", "lora_path": str(fleet.adapters[0])}
    assert httpx.post(f"{fleet.b.url}/v1/load_lora_adapter", json=load).status_code == 200
    assert httpx.post(f"{fleet.a.url}/v1/unload_lora_adapter", json={"lora_name": "first"}).status_code == 200
    wait_for(lambda: _gateway_routes(fleet, "first") == {"b"}, timeout=10)
    for _ in range(6):
        answer = _complete(fleet.gateway.url, "first")
        assert answer.headers["x-pagefleet-replica"] == "b"
        assert answer.json()["choices"][0]["text"] == expected


@pytest.mark.parametrize("door_kind", ["gateway", "envoy"])
def test_an_adapter_no_replica_serves_is_loaded_where_the_policy_says(
    fleet: LoRAFleet, door_kind: str, tmp_path: Path
) -> None:
    """The same through both front doors: their director loads it first (director.py)."""
    for replica in (fleet.a, fleet.b):
        httpx.post(f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": "first"})
    wait_for(lambda: not _gateway_routes(fleet, "first"), timeout=10)
    with front_door(door_kind, fleet.redis.url, tmp_path, fleet.a.url) as door:
        answer = _complete(door.url, "first")  # the catalog in Redis knows where it lives
    assert answer.status_code == 200, answer.text
    chosen = {"a": fleet.a, "b": fleet.b}[answer.headers["x-pagefleet-replica"]]
    assert _serves(chosen.url, "first")


def test_an_adapter_nobody_knows_is_a_404_naming_the_served_models(fleet: LoRAFleet) -> None:
    answer = _complete(fleet.gateway.url, "no-such-adapter")
    assert answer.status_code == 404
    assert "tiny" in answer.json()["error"]["message"]
