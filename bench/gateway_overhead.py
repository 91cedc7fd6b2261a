"""What the gateway costs: the same requests sent to one replica directly and through the
gateway, in one run.

    python bench/gateway_overhead.py [--requests 400] [--clients 16] [--policy kv]

One replica of the small random-weight Llama of bench/routing.py (float32, one thread; a
one-token answer takes about 12 ms, so the gateway's share stands out from the engine's
jitter), Redis and the gateway, started by the same code as `pagefleet up`.

Latency: sequential one-token completions, alternating direct and gateway calls; the added
latency is the median of the paired differences (each gateway call minus the direct call
just before it, which cancels drift; target: at most 1 ms); then the CPU each process spends
per request, through the gateway and direct (where the added latency goes). Throughput: `--clients`
concurrent streams of 32 tokens, direct then through the gateway; the ratio of output
tokens/s (target: at least 90%).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import free_port, progress
from routing import build_model

from pagefleet.cli.up import Fleet, FleetSpec, ModelSpec

MODEL = "small"


def start_fleet(log_dir: Path, policy: str, model_dir: Path) -> tuple[Fleet, str]:
    spec = FleetSpec(
        gateway_flags=["--policy", policy],
        redis_port=free_port(),
        gateway_port=free_port(),
        first_engine_port=free_port(),
        log_dir=log_dir,
        models=[ModelSpec(name=MODEL, model=str(model_dir), replicas=1, flags=["--dtype", "float32"])],
    )
    fleet = Fleet(spec)
    deadline = time.monotonic() + 600
    fleet.start_redis()
    fleet.start_gateway()
    replica = fleet.start_engine(spec.models[0], 0, spec.first_engine_port)
    fleet.wait_healthy(replica, deadline)
    fleet.wait_healthy(fleet.gateway_url, deadline)
    fleet.wait_models({MODEL}, deadline)
    return fleet, replica


def latencies(direct: str, gateway: str, requests: int) -> tuple[list[float], list[float]]:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0.0}
    times: dict[str, list[float]] = {direct: [], gateway: []}
    with httpx.Client(timeout=60) as client:
        for url in (direct, gateway):  # warm up both paths
            client.post(f"{url}/v1/completions", json=body).raise_for_status()
        for _ in range(requests):
            for url in (direct, gateway):
                started = time.perf_counter()
                client.post(f"{url}/v1/completions", json=body).raise_for_status()
                times[url].append(time.perf_counter() - started)
    return times[direct], times[gateway]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of a process so far (Linux /proc)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        fields = Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def cpu_per_request(fleet: Fleet, url: str, requests: int) -> dict[str, float]:
    """Milliseconds of CPU per sequential one-token request, per process of the fleet. A
    sequential request is a serial chain through them, so these add up to its latency."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0.0}
    pids = {(c.name if c.name in ("redis", "gateway") else "engine"): c.process.pid for c in fleet.children}
    with httpx.Client(timeout=60) as client:
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for _ in range(requests):
            client.post(f"{url}/v1/completions", json=body).raise_for_status()
        return {name: (cpu_seconds(pid) - before[name]) / requests * 1e3 for name, pid in pids.items()}


async def throughput(url: str, clients: int, rounds: int) -> float:
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 32, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> int:
        tokens = 0
        for _ in range(rounds):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    tokens += line.startswith("data: {")
        return tokens

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(client) for _ in range(clients))))
        return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policy", default="kv", help="the gateway's routing policy")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        progress("building the small model; starting Redis, one replica and the gateway")
        fleet, replica = start_fleet(Path(logs), args.policy, build_model(Path(logs) / "small"))
        try:
            progress(f"latency: {args.requests} one-token requests each way")
            direct, through = latencies(replica, fleet.gateway_url, args.requests)
            progress("CPU per request of each process, through the gateway then direct")
            cpu_through = cpu_per_request(fleet, fleet.gateway_url, args.requests)
            cpu_direct = cpu_per_request(fleet, replica, args.requests)
            progress(f"throughput: {args.clients} concurrent streams, direct then through the gateway")
            direct_rate = asyncio.run(throughput(replica, args.clients, args.rounds))
            gateway_rate = asyncio.run(throughput(fleet.gateway_url, args.clients, args.rounds))
        finally:
            fleet.stop()
    added = statistics.median(g - d for g, d in zip(through, direct, strict=True))
    print(
        f"latency p50 direct {statistics.median(direct) * 1e3:.2f} ms, through the gateway "
        f"{statistics.median(through) * 1e3:.2f} ms (added {added * 1e3:.2f} ms) | throughput direct "
        f"{direct_rate:.1f} tok/s, through the gateway {gateway_rate:.1f} tok/s (x{gateway_rate / direct_rate:.2f})",
        flush=True,
    )
    print(
        "CPU per request (ms), through the gateway: "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in cpu_through.items())
        + " | direct: "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in cpu_direct.items()),
        flush=True,
    )


if __name__ == "__main__":
    main()
