"""`pagefleet sim-fleet`: many simulated replicas (`pagefleet serve --simulate`) on one
machine, each on its own port, a few processes each hosting a share of them.

    pagefleet sim-fleet --replicas 32 --profile gpu-8b --time-scale 4 --redis-url redis://localhost:6379/0

Each replica is the real server (HTTP routes, scheduler, KV cache, prefix cache, Redis
record, KV events, metrics) over its profile's cost model; replica i listens on
base-port + i. Flags after the known ones go to every replica as `pagefleet serve` flags.
It prints `sim fleet ready` once every replica answers /health, and stops them all on
Ctrl-C or SIGTERM. One process per core is the default: a replica's engine thread sleeps
through its steps, so dozens share a core (the benchmark prints the host's CPU use).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

READY_TIMEOUT_S = 300.0


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser("sim-fleet", help="many simulated replicas on one machine (docs/routing.md)")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--profile", default="gpu-8b", help="gpu-8b, gpu-70b-tp4 or cpu-smollm2")
    parser.add_argument("--time-scale", type=float, default=1.0, help="stretch every modelled duration K times")
    parser.add_argument("--processes", type=int, default=0, help="host processes (default: one per core)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, default=9100)
    parser.add_argument("--redis-url", default=None, help="where the replicas publish their records and events")
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: sim-PROFILE)")
    parser.add_argument("--ports", default=None, help=argparse.SUPPRESS)  # a host process's share
    parser.set_defaults(run=run, takes_flags=True)


def replica_flags(args: argparse.Namespace, port: int) -> list[str]:
    """`pagefleet serve` flags of the replica on `port`."""
    flags = [
        "--simulate", args.profile,
        "--time-scale", str(args.time_scale),
        "--served-model-name", args.served_model_name or f"sim-{args.profile}",
        "--host", args.host,
        "--port", str(port),
        "--replica-id", f"sim-{args.profile}-{port}",
        "--log-level", "WARNING",
    ]  # fmt: skip
    if args.redis_url:
        flags += ["--redis-url", args.redis_url]
    return flags + list(args.flags)


def run(args: argparse.Namespace) -> int:
    if args.ports is not None:
        return host_replicas(args, [int(port) for port in args.ports.split(",")])
    ports = [args.base_port + i for i in range(args.replicas)]
    processes = max(1, min(args.processes or os.cpu_count() or 1, len(ports)))
    shares = [ports[i::processes] for i in range(processes)]
    with _hosts(args, shares) as children:
        if not _wait_ready(args.host, ports, children):
            return 1
        print(f"sim fleet ready: {len(ports)} {args.profile} replicas on ports {ports[0]}-{ports[-1]}", flush=True)
        stop = _stop_flag()
        while not stop() and all(child.poll() is None for child in children):
            time.sleep(0.2)
        return 0 if stop() else 1


@contextlib.contextmanager
def _hosts(args: argparse.Namespace, shares: list[list[int]]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One host process per share of the ports, stopped (SIGTERM, then SIGKILL) on exit."""
    base = [sys.executable, "-m", "pagefleet.cli.main", "sim-fleet", "--profile", args.profile]
    base += ["--time-scale", str(args.time_scale), "--host", args.host]
    if args.redis_url:
        base += ["--redis-url", args.redis_url]
    if args.served_model_name:
        base += ["--served-model-name", args.served_model_name]
    children = []
    try:
        for share in shares:
            command = [*base, "--ports", ",".join(map(str, share)), *args.flags]
            children.append(subprocess.Popen(command))
        yield children
    finally:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def _wait_ready(host: str, ports: list[int], children: list[subprocess.Popen[bytes]]) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = list(ports)
    while waiting and time.monotonic() < deadline:
        if any(child.poll() is not None for child in children):
            print("pagefleet sim-fleet: a host process exited before its replicas were ready", file=sys.stderr)
            return False
        waiting = [port for port in waiting if not _healthy(f"http://{host}:{port}/health")]
        time.sleep(0.2 if waiting else 0)
    if waiting:
        print(f"pagefleet sim-fleet: ports {waiting} not healthy after {READY_TIMEOUT_S:.0f} s", file=sys.stderr)
    return not waiting


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _stop_flag() -> Any:
    stopped: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: stopped.append(signum))
    return lambda: bool(stopped)


def host_replicas(args: argparse.Namespace, ports: list[int]) -> int:
    """Serve the replicas of `ports` from this process, on one event loop."""
    from pagefleet.cli.flags import parse_flags
    from pagefleet.engine.server.settings import ServerSettings

    settings = [parse_flags(ServerSettings, replica_flags(args, port), "pagefleet sim-fleet") for port in ports]
    if any(s is None for s in settings):
        return 2
    asyncio.run(_serve_all([s for s in settings if s is not None]))
    return 0


async def _serve_all(all_settings: list[Any]) -> None:
    import uvicorn

    from pagefleet.engine.server.app import create_app

    class HostedServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the host handles them for every server
            yield

    servers = []
    for settings in all_settings:
        app = create_app(settings)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False)
        servers.append(HostedServer(config))

    def stop_all() -> None:
        for server in servers:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop_all)
    await asyncio.gather(*(server.serve() for server in servers))
