"""Prefill/decode disaggregation against colocation: long prompts arriving while short
requests decode, on 2 colocated replicas and on 1 prefill + 1 decode replica, behind the
gateway, with the same arrival schedule, in one run.

    python bench/disaggregation.py [--seconds 30] [--short-every 0.4] [--long-every 3]

SmolLM2-135M-Instruct (float32, one thread per replica; the machine's 2 cores are shared by
both replicas, the gateway and this client). Short requests: a 64-token prompt, 48 streamed
tokens. Long requests: a 1536-token prompt, 8 tokens. Reported per layout: inter-token
latency p50/p99 and TTFT p50/p99 of the short requests, TTFT of the long ones, output
tokens/s, and the KV bytes moved per disaggregated request (from the prefill replica's
/metrics). Where the isolation shows is the short requests' p99 inter-token latency: a
colocated replica computes a long prompt chunk between their tokens; a decode replica never
does. With both replicas on the same two cores, a prefill still takes CPU from the decode
replica, so the benefit here is smaller than on separate GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import free_port, progress
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.cli.up import Fleet, FleetSpec, ModelSpec

MODEL = "smollm2"
ENGINE = ["--dtype", "float32", "--kv-cache-memory", str(512 << 20), "--max-num-batched-tokens", "512"]


@dataclass
class Times:
    kind: str
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


def schedule(
    seconds: float, short_every: float, long_every: float, seed: int = 0
) -> list[tuple[float, str, list[int]]]:
    """(arrival time, kind, prompt token ids), the same for every layout."""
    rng = random.Random(seed)
    arrivals = []
    t = 0.0
    while t < seconds:
        arrivals.append((t, "short", [rng.randrange(100, 40000) for _ in range(64)]))
        t += rng.expovariate(1 / short_every)
    t = 1.0
    while t < seconds:
        arrivals.append((t, "long", [rng.randrange(100, 40000) for _ in range(1536)]))
        t += long_every
    return sorted(arrivals, key=lambda a: a[0])


async def one(client: httpx.AsyncClient, url: str, kind: str, prompt: list[int]) -> Times:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 48 if kind == "short" else 8, "temperature": 0.0}
    body |= {"ignore_eos": True, "stream": True}
    times = Times(kind)
    started = last = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if not choices or not choices[0]["text"]:
                continue
            now = time.perf_counter()
            if times.tokens == 0:
                times.ttft = now - started
            else:
                times.gaps.append(now - last)
            last, times.tokens = now, times.tokens + 1
    return times


async def replay(url: str, arrivals: list[tuple[float, str, list[int]]]) -> tuple[list[Times], float]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=256)) as client:
        started = time.perf_counter()

        async def at(offset: float, kind: str, prompt: list[int]) -> Times:
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - started)))
            return await one(client, url, kind, prompt)

        results = await asyncio.gather(*(at(*arrival) for arrival in arrivals))
        return list(results), time.perf_counter() - started


def start(layout: str, logs: Path) -> Fleet:
    if layout == "colocated":
        models = [ModelSpec(name=MODEL, model="smollm2-135m-instruct", replicas=2, flags=ENGINE)]
    else:
        models = [
            ModelSpec(name=MODEL, model="smollm2-135m-instruct", role=role, flags=ENGINE)
            for role in ("prefill", "decode")
        ]
    spec = FleetSpec(
        kv_tier=False,  # each replica computes what it has not cached (docs/kv-tiers.md)
        redis_port=free_port(),
        gateway_port=free_port(),
        first_engine_port=free_port(),
        log_dir=logs / layout,
        models=models,
    )
    fleet = Fleet(spec)
    deadline = time.monotonic() + 900
    fleet.start_redis()
    fleet.start_gateway()
    urls = []
    for model in models:
        for index in range(model.replicas):
            urls.append(fleet.start_engine(model, index).url)
    for url in urls:
        fleet.wait_healthy(url, deadline)
    fleet.wait_healthy(fleet.gateway_url, deadline)
    fleet.wait_models({MODEL}, deadline)
    fleet.engine_urls = urls  # type: ignore[attr-defined]
    time.sleep(2)  # every replica's first report, so the gateway sees both roles
    return fleet


def sent_bytes(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pagefleet:kv_transfer_bytes_total" and sample.labels.get("direction") == "sent":
                return sample.value
    return 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_layout(layout: str, arrivals: list[tuple[float, str, list[int]]], logs: Path) -> dict[str, float]:
    progress(f"{layout}: starting the fleet")
    fleet = start(layout, logs)
    try:
        progress(f"{layout}: warming up, then {len(arrivals)} requests")
        asyncio.run(replay(fleet.gateway_url, arrivals[:4]))
        before = sent_bytes(fleet.engine_urls[0]) if layout != "colocated" else 0.0  # type: ignore[attr-defined]
        results, elapsed = asyncio.run(replay(fleet.gateway_url, arrivals))
        moved = sent_bytes(fleet.engine_urls[0]) - before if layout != "colocated" else 0.0  # type: ignore[attr-defined]
    finally:
        fleet.stop()
    short = [r for r in results if r.kind == "short"]
    long = [r for r in results if r.kind == "long"]
    gaps = [g for r in short for g in r.gaps]
    return {
        "itl_p50_ms": 1000 * statistics.median(gaps),
        "itl_p99_ms": 1000 * pct(gaps, 0.99),
        "short_ttft_p50_ms": 1000 * statistics.median(r.ttft for r in short),
        "short_ttft_p99_ms": 1000 * pct([r.ttft for r in short], 0.99),
        "long_ttft_p50_ms": 1000 * statistics.median(r.ttft for r in long),
        "long_ttft_p99_ms": 1000 * pct([r.ttft for r in long], 0.99),
        "tokens_per_s": sum(r.tokens for r in results) / elapsed,
        "kv_mib_per_request": moved / len(results) / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--short-every", type=float, default=0.4, help="mean seconds between short requests")
    parser.add_argument("--long-every", type=float, default=3.0, help="seconds between long prompts")
    args = parser.parse_args()
    arrivals = schedule(args.seconds, args.short_every, args.long_every)
    with tempfile.TemporaryDirectory() as logs:
        results = {layout: run_layout(layout, arrivals, Path(logs)) for layout in ("colocated", "disaggregated")}
    kinds = {kind: sum(a[1] == kind for a in arrivals) for kind in ("short", "long")}
    print(f"\n{kinds['short']} short + {kinds['long']} long requests over {args.seconds:g} s, same schedule")
    print(f"{'':22} {'2 colocated':>12} {'1P + 1D':>12} {'P/D vs colocated':>18}")
    for name in results["colocated"]:
        colocated, split = results["colocated"][name], results["disaggregated"][name]
        ratio = f"{split / colocated:.2f}x" if colocated else "-"
        print(f"{name:22} {colocated:12.1f} {split:12.1f} {ratio:>18}")


if __name__ == "__main__":
    main()
