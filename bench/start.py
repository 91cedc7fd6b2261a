"""Start-to-ready of one replica: cold (converting the model's GGUF) and warm (from the
model cache that replicas share), in one run.

    python bench/start.py [--model smollm2-135m-instruct]

Starts `pagefleet serve` twice on an empty cache directory of its own (PAGEFLEET_CACHE_DIR):
the first start converts the GGUF file and writes the cache, the second loads what the
first wrote, as a model's second replica does on a shared `spec.modelCache`. Each time is
from the process's start to the first 200 of `/ready` (the model loaded and warmed up).
Prints both and cold/warm.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        progress("cold start: an empty model cache (the GGUF file is converted)")
        cold = start_to_ready(args.model, cache, args.threads)
        progress("warm start: the cache the first start wrote")
        warm = start_to_ready(args.model, cache, args.threads)
    print(f"start to ready: cold {cold:.1f} s | warm {warm:.1f} s | cold/warm x{cold / warm:.1f}", flush=True)


if __name__ == "__main__":
    main()
