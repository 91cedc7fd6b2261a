"""Routing policies compared on one bursty workload, replayed against each in one run.

    python bench/routing.py [--plot ../docs/routing-ttft.png]

Three replicas of a small random-weight Llama (SmolLM2's tokenizer; 4 layers) with small KV
budgets (96 blocks of 16 tokens each) behind the gateway, a fresh fleet per policy (kv,
round_robin, least_requests, prefix). The same arrival schedule each time: bursts of 12
streaming requests every 2 s, 12 bursts; one in five is long (1000-token prompt, 64 new tokens), the
rest short (a 40-token system prefix out of three, then 10..60 tokens; 32 new tokens).
Reports TTFT p50/p99, end-to-end p99, output tokens/s, preemptions per replica, and each
policy's ratio to round robin (target: kv's p99 TTFT at most 0.7x round robin's, with fewer
preemptions); plots the TTFT distributions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import free_port, progress

from pagefleet.cli.up import Fleet, FleetSpec, ModelSpec

POLICIES = ["round_robin", "kv", "least_requests", "prefix"]
REPLICAS = 3
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "96", "--block-size", "16", "--max-num-batched-tokens", "512"]


@dataclass(slots=True)
class Arrival:
    at: float
    prompt: list[int]
    max_tokens: int


@dataclass(slots=True)
class Outcome:
    ttft: float
    e2e: float
    tokens: int


def build_model(directory: Path) -> Path:
    """A 4-layer random Llama with SmolLM2's tokenizer, so the replicas are quick but real."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagefleet.engine.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def schedule(seed: int = 0, bursts: int = 12, per_burst: int = 12, gap: float = 2.0) -> list[Arrival]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 40000) for _ in range(40)] for _ in range(3)]
    arrivals = []
    for burst in range(bursts):
        for _ in range(per_burst):
            if rng.random() < 0.2:
                prompt, max_tokens = [rng.randrange(100, 40000) for _ in range(1000)], 64
            else:
                tail = [rng.randrange(100, 40000) for _ in range(rng.randint(10, 60))]
                prompt, max_tokens = rng.choice(prefixes) + tail, 32
            arrivals.append(Arrival(burst * gap + rng.random() * 0.2, prompt, max_tokens))
    return sorted(arrivals, key=lambda a: a.at)


async def replay(url: str, arrivals: list[Arrival]) -> tuple[list[Outcome], float]:
    async def one(client: httpx.AsyncClient, arrival: Arrival, start: float) -> Outcome:
        await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
        body = {"model": "tiny", "prompt": arrival.prompt, "max_tokens": arrival.max_tokens, "ignore_eos": True}
        sent = time.perf_counter()
        first, tokens = 0.0, 0
        async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    tokens += 1
                    first = first or time.perf_counter() - sent
        return Outcome(first, time.perf_counter() - sent, tokens)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as client:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(one(client, a, start) for a in arrivals))
        return list(outcomes), time.perf_counter() - start


def preemptions(url: str) -> int:
    text = httpx.get(f"{url}/metrics").text
    return int(
        sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("pagefleet:num_preemptions_total"))
    )


def run_policy(policy: str, model_dir: Path, arrivals: list[Arrival], logs: Path) -> dict[str, object]:
    spec = FleetSpec(
        redis_port=free_port(),
        gateway_port=free_port(),
        first_engine_port=free_port(),
        log_dir=logs / policy,
        gateway_flags=["--policy", policy],
        models=[ModelSpec(name="tiny", model=str(model_dir), replicas=REPLICAS, flags=ENGINE_FLAGS)],
    )
    fleet = Fleet(spec)
    deadline = time.monotonic() + 300
    try:
        fleet.start_redis()
        fleet.start_gateway()
        urls = [fleet.start_engine(spec.models[0], i, spec.first_engine_port + i) for i in range(REPLICAS)]
        for url in urls:
            fleet.wait_healthy(url, deadline)
        fleet.wait_healthy(fleet.gateway_url, deadline)
        fleet.wait_models({"tiny"}, deadline)
        time.sleep(1.0)
        outcomes, seconds = asyncio.run(replay(fleet.gateway_url, arrivals))
        per_replica = [preemptions(url) for url in urls]
    finally:
        fleet.stop()
    ttft = sorted(o.ttft for o in outcomes)
    e2e = sorted(o.e2e for o in outcomes)

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "ttft": ttft,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "e2e_p99": pct(e2e, 0.99),
        "tokens_per_s": sum(o.tokens for o in outcomes) / seconds,
        "preemptions": per_replica,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plot", type=Path, default=None, help="write the TTFT distributions here (PNG)")
    args = parser.parse_args()
    arrivals = schedule()
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        progress("building the small model")
        model_dir = build_model(Path(scratch) / "tiny")
        for policy in POLICIES:
            progress(f"{policy}: {len(arrivals)} requests")
            results[policy] = run_policy(policy, model_dir, arrivals, Path(scratch))
    base = results["round_robin"]
    for policy, result in results.items():
        print(
            f"{policy:15s} TTFT p50 {result['ttft_p50']:.2f}s p99 {result['ttft_p99']:.2f}s "
            f"(x{result['ttft_p99'] / base['ttft_p99']:.2f} of round robin) | e2e p99 {result['e2e_p99']:.2f}s "
            f"(x{result['e2e_p99'] / base['e2e_p99']:.2f}) | {result['tokens_per_s']:.0f} tok/s "
            f"(x{result['tokens_per_s'] / base['tokens_per_s']:.2f}) | preemptions per replica {result['preemptions']}",
            flush=True,
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(7, 4))
        for policy, result in results.items():
            ttft = result["ttft"]
            axis.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=policy)
        axis.set_xlabel("time to first token (s)")
        axis.set_ylabel("fraction of requests")
        axis.set_title("TTFT by routing policy (3 replicas, bursty mixed workload)")
        axis.legend()
        axis.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        progress(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
