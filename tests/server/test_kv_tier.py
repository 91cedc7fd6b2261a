"""KV beyond one replica, through `pagefleet serve`: a replica reads a prompt's blocks that
another computed from the shared file tier (`--kv-cache-dir`), or pulls them from the peer
the gateway names (`x-pagefleet-kv-peer`). OpenAI's usage counts them as cached tokens, the
answers equal computed ones, and /metrics shows where they came from."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pagefleet.engine import LLM, SamplingParams
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import random_prompts
from tests.processes import (
    EngineServer,
    free_port,
    idle_with_every_block_free,
    metrics,
    start_server,
    stop_server,
    wait_for,
)

FLAGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--enable-prompt-tokens-details")


@dataclass
class Pair:
    holder: EngineServer  # no file tier: what it caches lives only in its memory
    reader: EngineServer  # a file tier in `shared`
    shared: Path


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    folder = tmp_path_factory.mktemp("kv-peers")
    holder = start_server(str(tiny_llama), folder / "holder.log", *FLAGS)
    # The tiny model computes a prompt faster than any pull (the cost model would refuse them):
    # "always" pulls whenever the peer may hold more.
    reader = start_server(
        str(tiny_llama),
        folder / "reader.log",
        *FLAGS,
        "--kv-cache-dir",
        str(folder / "kv"),
        "--kv-peer-pulls",
        "always",
    )
    yield Pair(holder, reader, folder / "kv")
    stop_server(reader)
    stop_server(holder)


def _complete(server: EngineServer, prompt: list[int], peer: str | None = None) -> dict:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    headers = {"x-pagefleet-kv-peer": peer} if peer is not None else {}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def _cached(answer: dict) -> int:
    return int((answer["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0))  # null when none was


def test_a_new_replica_reads_what_another_computed_from_the_file_tier(tiny_llama: Path, pair: Pair) -> None:
    prompt = random_prompts([50], TINY_VOCAB, seed=13)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    other = LLM(str(tiny_llama), dtype="float32", kv_cache_dir=str(pair.shared))  # the replica that computed it
    computed = other.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    answer = _complete(pair.reader, prompt)
    assert answer["choices"][0]["text"] == computed.text
    assert _cached(answer) == 48  # 3 full blocks of 16
    samples = metrics(pair.reader)
    assert samples["vllm:external_prefix_cache_hits_total{engine=0}"] == 48
    assert samples["vllm:external_prefix_cache_queries_total{engine=0}"] >= 48
    assert samples["pagefleet:kv_tier_hits_total"] == 1
    assert samples["pagefleet:kv_tier_read_bytes_total"] > 0
    assert samples["pagefleet:kv_tier_bad_files_total"] == 0
    wait_for(lambda: idle_with_every_block_free(pair.reader))


def test_a_replica_pulls_the_prefix_its_peer_caches(pair: Pair) -> None:
    prompt = random_prompts([70], TINY_VOCAB, seed=14)[0]
    computed = _complete(pair.holder, prompt)
    assert _cached(computed) == 0
    pulled = _complete(pair.reader, prompt, peer=pair.holder.url)
    assert pulled["choices"][0]["text"] == computed["choices"][0]["text"]
    assert _cached(pulled) == 64  # 4 full blocks of 16, from the holder's memory
    assert metrics(pair.reader)["pagefleet:kv_peer_pulls_total{outcome=hit}"] == 1
    assert metrics(pair.holder)["pagefleet:kv_transfer_blocks_total{direction=peer_sent}"] == 4
    # The reader has it now: a second hint is not followed.
    assert _cached(_complete(pair.reader, prompt, peer=pair.holder.url)) == 64
    assert metrics(pair.reader)["pagefleet:kv_peer_pulls_total{outcome=not_needed}"] == 1
    for server in (pair.holder, pair.reader):
        wait_for(lambda s=server: idle_with_every_block_free(s))


def test_a_peer_that_cannot_answer_leaves_the_prompt_computed(pair: Pair) -> None:
    prompt = random_prompts([40], TINY_VOCAB, seed=15)[0]
    gone = f"http://127.0.0.1:{free_port()}"
    answer = _complete(pair.reader, prompt, peer=gone)
    assert _cached(answer) == 0 and len(answer["choices"][0]["text"]) > 0
    missing = random_prompts([40], TINY_VOCAB, seed=16)[0]  # the holder never saw it
    assert _cached(_complete(pair.reader, missing, peer=pair.holder.url)) == 0
    samples = metrics(pair.reader)
    assert samples["pagefleet:kv_peer_pulls_total{outcome=failed}"] == 1
    assert samples["pagefleet:kv_peer_pulls_total{outcome=miss}"] == 1
    wait_for(lambda: idle_with_every_block_free(pair.reader))


def test_a_holder_refuses_another_layout_before_sending_a_byte(pair: Pair) -> None:
    """Both KV routes (`/kv/prefix` for peers, `/kv/pull` for decode replicas) check the
    caller's layout first: 409 naming the difference, 400 for no layout at all."""
    layout = {
        "model": pair.holder.model,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
        "block_size": 32,  # the holder's blocks are of 16
        "dtype": "float32",
    }
    asks = {
        "/kv/prefix": {"hashes": ["0" * 16], "token_ids": list(range(32)), "min_blocks": 1},
        "/kv/pull": {"request_id": "nothing-pinned", "block_ids": [0]},
    }
    failures = metrics(pair.holder)["pagefleet:kv_transfer_failures_total"]
    for path, body in asks.items():
        refused = httpx.post(f"{pair.holder.url}{path}", json={**body, "layout": layout}, timeout=10)
        assert refused.status_code == 409, refused.text
        assert "block_size 16 on this replica, 32 on the" in refused.json()["error"]["message"]
        unreadable = httpx.post(f"{pair.holder.url}{path}", json={**body, "layout": {}}, timeout=10)
        assert unreadable.status_code == 400, unreadable.text
    assert metrics(pair.holder)["pagefleet:kv_transfer_failures_total"] == failures + 2
    wait_for(lambda: idle_with_every_block_free(pair.holder))
