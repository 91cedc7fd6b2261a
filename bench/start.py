"""Start-to-ready of one replica: cold (converting the model's GGUF) and warm (from the
model cache that replicas share); then requests that arrive at a model scaled to zero.

    python bench/start.py [--model smollm2-135m-instruct] [--held 20]

Starts `pagefleet serve` twice on an empty cache directory of its own (PAGEFLEET_CACHE_DIR):
the first start converts the GGUF file and writes the cache, the second loads what the
first wrote, as a model's second replica does on a shared `spec.modelCache`. Each time is
from the process's start to the first 200 of `/ready` (the model loaded and warmed up).

Then `pagefleet up` runs the model with `min_replicas: 0` (no replica), and `--held`
streamed requests arrive at once through its gateway: the gateway holds them while a
replica starts. Prints how many succeeded, their time to first token (first, median,
last) against the warm start-to-ready, and how far any request's first token came ahead
of an earlier request's (0 when they come in arrival order).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import free_port, progress


def start_to_ready(model: str, cache: str, threads: int) -> float:
    """Seconds from starting `pagefleet serve` to its first 200 of /ready."""
    port = free_port()
    env = {**os.environ, "PAGEFLEET_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "pagefleet.cli.main", "serve", "--model", model, "--port", str(port)]
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"pagefleet serve exited during start-up (code {process.returncode})")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    finally:
        process.terminate()
        process.wait(timeout=60)


async def held_requests(gateway: str, model: str, count: int) -> list[tuple[int, float, float]]:
    """`count` streamed requests sent at once, 10 ms apart: (status, sent, first token),
    times from the first request's start."""
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=count + 4)
    ) as client:
        origin = time.perf_counter()

        async def one(index: int) -> tuple[int, float, float]:
            await asyncio.sleep(index * 0.01)
            sent = time.perf_counter() - origin
            body = {"model": model, "prompt": "Hello", "max_tokens": 8, "stream": True}
            async with client.stream("POST", f"{gateway}/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        return response.status_code, sent, time.perf_counter() - origin
                return response.status_code, sent, float("nan")

        return await asyncio.gather(*(one(i) for i in range(count)))


def from_zero(model: str, count: int) -> list[tuple[int, float, float]]:
    """`pagefleet up` with `model` at min_replicas 0, and `count` requests held at once."""
    with tempfile.TemporaryDirectory() as folder:
        gateway_port = free_port()
        fleet = Path(folder) / "fleet.yaml"
        fleet.write_text(
            f"redis_port: {free_port()}\ngateway_port: {gateway_port}\nfirst_engine_port: {free_port()}\n"
            f"log_dir: {folder}/logs\nmodels:\n"
            f"  - {{name: {model}, model: {model}, min_replicas: 0, flags: [--dtype, float32]}}\n"
        )
        command = [sys.executable, "-m", "pagefleet.cli.main", "up", "--fleet", str(fleet)]
        up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert up.stdout is not None
            for line in up.stdout:
                if "fleet ready" in line:
                    break
            return asyncio.run(held_requests(f"http://127.0.0.1:{gateway_port}", model, count))
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--held", type=int, default=20, help="requests that arrive at the model scaled to zero")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        progress("cold start: an empty model cache (the GGUF file is converted)")
        cold = start_to_ready(args.model, cache, args.threads)
        progress("warm start: the cache the first start wrote")
        warm = start_to_ready(args.model, cache, args.threads)
    print(f"start to ready: cold {cold:.1f} s | warm {warm:.1f} s | cold/warm x{cold / warm:.1f}", flush=True)
    progress(f"from zero: {args.held} requests arrive at a model with no replica (pagefleet up, min_replicas 0)")
    held = from_zero(args.model, args.held)
    by_arrival = [first for _, _, first in held]
    firsts = sorted(by_arrival)
    # How far a request's first token came before that of one that arrived earlier (0: in order).
    ahead = max(max(by_arrival[:i], default=0.0) - first for i, first in enumerate(by_arrival))
    print(
        f"from zero: {sum(status == 200 for status, _, _ in held)}/{len(held)} succeeded | TTFT first "
        f"{firsts[0]:.1f} s, median {firsts[len(firsts) // 2]:.1f} s, last {firsts[-1]:.1f} s "
        f"(x{firsts[0] / warm:.2f} of the warm start-to-ready) | a later request ahead of an earlier one "
        f"by at most {max(ahead, 0.0) * 1e3:.0f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
