"""The operator's test world: a KMock Kubernetes API over HTTP with the CRD loaded, a real
redis-server, the official `kubernetes` client, and the operator running in a thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import redis

from pagefleet.operator.kube import PERMISSIONS
from pagefleet.operator.main import run_operator
from pagefleet.operator.settings import OperatorSettings
from tests.operator.cluster import ApiServer, Cluster
from tests.processes import RedisProcess, free_port, wait_for

GROUP, VERSION, PLURAL = "pagefleet.io", "v1alpha1", "inferencedeployments"
NAMESPACE = "models"


@pytest.fixture
def api_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ApiServer]:
    server = ApiServer().start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(server.kubeconfig())
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))  # what the operator logs in with
    yield server
    server.stop()


@pytest.fixture
def cluster(api_server: ApiServer) -> Cluster:
    assert api_server.cluster is not None
    return api_server.cluster


@dataclass
class Client:
    """The official client, as `kubectl` users' tools talk to the API."""

    custom: kubernetes.client.CustomObjectsApi
    apps: kubernetes.client.AppsV1Api
    core: kubernetes.client.CoreV1Api
    policy: kubernetes.client.PolicyV1Api

    def create(self, body: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, body)

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)  # type: ignore[no-any-return]

    def patch(self, name: str, body: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, body)

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)

    def deployment(self, name: str) -> dict[str, Any]:
        response = self.apps.read_namespaced_deployment(name, NAMESPACE, _preload_content=False)
        return response.json()  # type: ignore[no-any-return]


@pytest.fixture
def client(api_server: ApiServer) -> Iterator[Client]:
    configuration = kubernetes.client.Configuration(host=api_server.url)
    with kubernetes.client.ApiClient(configuration) as api:
        yield Client(
            kubernetes.client.CustomObjectsApi(api),
            kubernetes.client.AppsV1Api(api),
            kubernetes.client.CoreV1Api(api),
            kubernetes.client.PolicyV1Api(api),
        )


@pytest.fixture
def redis_client(redis_server: RedisProcess) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def operator_settings(redis_url: str) -> OperatorSettings:
    return OperatorSettings(
        redis_url=redis_url,
        engine_image="registry.example/pagefleet-engine:test",
        reconcile_interval_s=1.0,
        health_port=None,
        metrics_port=free_port(),
    )


@pytest.fixture
def operator(api_server: ApiServer, redis_server: RedisProcess) -> Iterator[OperatorSettings]:
    """The operator, embedded: kopf's own loop in a thread, stopped after the test."""
    settings = operator_settings(redis_server.url)
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(run_operator(settings, stop_flag=stop, ready_flag=ready))
        except BaseException as error:  # surfaced by the fixture, not lost in the thread
            errors.append(error)
            ready.set()

    thread = threading.Thread(target=run, name="operator", daemon=True)
    thread.start()
    assert ready.wait(30), "the operator did not start"
    assert not errors, errors
    yield settings
    stop.set()
    thread.join(30)
    assert not thread.is_alive(), "the operator did not stop"
    assert not errors, errors
    # Every call the operator made is one that kube.PERMISSIONS (and so the RBAC) grants.
    assert api_server.cluster is not None
    calls = api_server.cluster.operator_calls
    assert calls, "the operator made no calls"
    refused = {
        (group, resource, verb) for group, resource, verb in calls if verb not in PERMISSIONS.get((group, resource), ())
    }
    assert not refused, f"calls outside kube.PERMISSIONS: {sorted(refused)}"


def eventually(check: Callable[[], Any], timeout: float = 15.0, interval: float = 0.1) -> Any:
    """The first truthy result of `check` (an AssertionError, a missing key or an API error
    in `check` means "not yet")."""
    return wait_for(check, timeout, interval, retry_on=(AssertionError, KeyError, kubernetes.client.ApiException))
