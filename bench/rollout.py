"""A rolling update and a scale-down under steady load: no request may fail or be cut.

    python bench/rollout.py [--replicas 3] [--rate 2] [--steady-seconds 20]

`pagefleet up` serves SmolLM2 (float32) with `--replicas` replicas behind its gateway. A
steady open-loop load (`--rate` requests/s, half of them streamed, 32 output tokens each)
runs through four phases: steady state; a rollout (`pagefleet up --rollout`: every replica
replaced in turn, each new one ready before the old one drains); a scale-down to one
replica (the fleet file changed: the others drain); and steady state on one replica.

Prints, per phase: requests, failures (any answer but a complete 200), cut streams, and
time to first token (p50, p99) of the streamed ones; then the rollout's and the
scale-down's TTFT p99 against the first steady state's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from common import free_port, progress
from serve import percentile

MODEL = "smollm2-135m-instruct"


@dataclass(slots=True)
class Phase:
    name: str
    ttfts: list[float] = field(default_factory=list)
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    cut_streams: int = 0


class FleetOutput:
    """`pagefleet up`'s lines, read in a thread, so that waiting for one can time out."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert process.stdout is not None
        stdout = process.stdout
        threading.Thread(target=lambda: self.lines.extend(stdout), daemon=True).start()

    def wait_for(self, text: str, count: int = 1, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while sum(text in line for line in self.lines) < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"pagefleet up never said {text!r}:\n{''.join(self.lines[-20:])}")
            time.sleep(0.2)


async def one_request(client: httpx.AsyncClient, url: str, stream: bool, phase: Phase) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 32,
        "ignore_eos": True,
        "stream": stream,
    }
    started = time.perf_counter()
    try:
        if not stream:
            answer = await client.post(url, json=body)
            if answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 32:
                phase.completed += 1
            else:
                phase.failures.append(f"{answer.status_code}: {answer.text[:200]}")
            return
        first, done, finished = None, False, False
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                phase.failures.append(f"stream {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        phase.failures.append(f"error event: {chunk['error']}")
                        return
                    choices = chunk.get("choices") or [{}]
                    if first is None and choices[0].get("delta", {}).get("content"):
                        first = time.perf_counter() - started
                    finished = finished or choices[0].get("finish_reason") == "length"
        if done and finished and first is not None:
            phase.completed += 1
            phase.ttfts.append(first)
        else:
            phase.cut_streams += 1
    except httpx.HTTPError as error:
        phase.failures.append(f"{type(error).__name__}: {error}")


async def steady_load(url: str, rate: float, phases: list[Phase], stop: threading.Event) -> None:
    """Open loop: one request every 1/rate s, counted in the phase current at its start."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=256)) as client:
        tasks, index = [], 0
        while not stop.is_set():
            tasks.append(asyncio.create_task(one_request(client, url, index % 2 == 0, phases[-1])))
            index += 1
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second")
    parser.add_argument("--steady-seconds", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        fleet = Path(folder) / "fleet.yaml"
        gateway_port = free_port()
        flags = '["--dtype", "float32", "--kv-cache-memory", "268435456"]'
        fleet.write_text(
            f"redis_port: {free_port()}\ngateway_port: {gateway_port}\nfirst_engine_port: {free_port()}\n"
            f"log_dir: {folder}/logs\nmodels:\n"
            f"  - {{name: {MODEL}, model: {MODEL}, replicas: {args.replicas}, flags: {flags}}}\n"
        )
        command = [sys.executable, "-m", "pagefleet.cli.main", "up", "--fleet", str(fleet)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        output = FleetOutput(up)
        try:
            progress(f"starting {args.replicas} replicas with pagefleet up")
            output.wait_for("fleet ready")
            phases = [Phase("steady")]
            stop = threading.Event()
            url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
            loader = threading.Thread(target=lambda: asyncio.run(steady_load(url, args.rate, phases, stop)))
            loader.start()
            time.sleep(args.steady_seconds)
            progress("rollout: every replica replaced in turn")
            phases.append(Phase("rollout"))
            up.send_signal(signal.SIGHUP)
            output.wait_for("rollout done")
            progress("scale-down to one replica: the fleet file changed")
            phases.append(Phase("scale-down"))
            drained_before = sum("drained and stopped" in line for line in output.lines)
            fleet.write_text(fleet.read_text().replace(f"replicas: {args.replicas}", "replicas: 1"))
            output.wait_for("fleet file applied")
            output.wait_for("drained and stopped", drained_before + args.replicas - 1)
            phases.append(Phase("steady, 1 replica"))
            time.sleep(args.steady_seconds / 2)
            stop.set()
            loader.join()
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)
    for phase in phases:
        ttft = (
            f"TTFT p50 {percentile(phase.ttfts, 0.5) * 1e3:5.0f} ms p99 {percentile(phase.ttfts, 0.99) * 1e3:5.0f} ms"
            if phase.ttfts
            else "no stream"
        )
        print(
            f"{phase.name:18s} requests {phase.completed + len(phase.failures) + phase.cut_streams:4d} | "
            f"failed {len(phase.failures)} | cut streams {phase.cut_streams} | {ttft}",
            flush=True,
        )
        for failure in phase.failures[:3]:
            print(f"  {failure}", flush=True)
    steady = percentile(phases[0].ttfts, 0.99)
    for phase in phases[1:3]:
        if phase.ttfts:
            print(f"{phase.name} TTFT p99 / steady: x{percentile(phase.ttfts, 0.99) / steady:.2f}", flush=True)


if __name__ == "__main__":
    main()
