"""The operator as its own process (`pagefleet operator`), as a user runs it, against the
test API server: one writer per resource at a time, deletions that never wait for the
periodic reconcile, and a clean exit on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from tests.operator.cluster import ApiServer, Cluster
from tests.operator.conftest import NAMESPACE, Client, eventually
from tests.operator.test_operator import publish, resource
from tests.processes import RedisProcess, free_port

# Log lines that must never appear: a race (409 on create, a handler retried), a timer
# kopf had to wait for or abandon, a session closed under a call.
BAD_LOG_LINES = ("HTTP 409", "failed temporarily", "still exiting", "orphaned", "ClientConnectionError", "Traceback")


@dataclass
class OperatorProcess:
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> int:
        """SIGTERM, as the kubelet sends it; the exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)

    def bad_lines(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if any(bad in line for bad in BAD_LOG_LINES)]


def start_operator(redis_url: str, log: Path) -> OperatorProcess:
    """`pagefleet operator` against the test API server ($KUBECONFIG), once it is live."""
    health = free_port()
    command = [
        sys.executable, "-m", "pagefleet.cli.main", "operator", "--redis-url", redis_url,
        "--engine-image", "registry.example/pagefleet-engine:test", "--reconcile-interval-s", "1",
        "--health-port", str(health), "--metrics-port", str(free_port()),
    ]  # fmt: skip
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{health}/healthz", timeout=1).status_code == 200:
                return OperatorProcess(process, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"the operator did not become live: {log.read_text()[-2000:]}")


@pytest.fixture
def operator_process(api_server: ApiServer, redis_server: RedisProcess, tmp_path: Path) -> Iterator[OperatorProcess]:
    running = start_operator(redis_server.url, tmp_path / "operator.log")
    yield running
    if running.process.poll() is None:
        assert running.stop() == 0
    assert not running.bad_lines(), running.bad_lines()


def deployment_writes(cluster: Cluster, name: str, since: int = 0) -> list[str]:
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}"
    return [method for method, written in cluster.writes[since:] if written == path]


def reconciled_periodically(cluster: Cluster, name: str, times: int) -> None:
    """Until the timer has read the resource's Deployment `times` more times."""
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}"
    before = cluster.operator_reads.count(path)
    eventually(lambda: cluster.operator_reads.count(path) >= before + times, timeout=5 * times + 20)


def test_a_restart_with_a_changed_spec_writes_the_deployment_exactly_once(
    api_server: ApiServer, cluster: Cluster, client: Client, redis_server: RedisProcess, tmp_path: Path
) -> None:
    first = start_operator(redis_server.url, tmp_path / "first.log")
    client.create(resource("smol", engine={"maxNumSeqs": 32}))
    eventually(lambda: client.get("smol")["status"]["observedGeneration"] == 1)
    reconciled_periodically(cluster, "smol", 2)
    assert first.stop() == 0 and not first.bad_lines(), first.bad_lines()

    client.patch("smol", {"spec": {"engine": {"maxNumSeqs": 64}}})  # while no operator runs
    since = len(cluster.writes)
    second = start_operator(redis_server.url, tmp_path / "second.log")
    try:
        args = lambda: client.deployment("smol")["spec"]["template"]["spec"]["containers"][0]["args"]  # noqa: E731
        eventually(lambda: args()[args().index("--max-num-seqs") + 1] == "64")
        eventually(lambda: client.get("smol")["status"]["observedGeneration"] == 2)
        reconciled_periodically(cluster, "smol", 2)
        assert deployment_writes(cluster, "smol", since) == ["PATCH"]
    finally:
        assert second.stop() == 0
    assert not second.bad_lines(), second.bad_lines()


def test_ten_resources_created_at_once_are_each_created_once_without_conflicts(
    operator_process: OperatorProcess, cluster: Cluster, client: Client
) -> None:
    names = [f"model-{index}" for index in range(10)]
    for name in names:
        client.create(resource(name))
    for name in names:
        eventually(lambda name=name: client.get(name)["status"]["observedGeneration"] == 1, timeout=30)
    reconciled_periodically(cluster, names[-1], 2)
    for kind in ("deployments", "services", "poddisruptionbudgets"):
        group = "apis/apps/v1" if kind == "deployments" else "api/v1" if kind == "services" else "apis/policy/v1"
        posts = [path for method, path in cluster.writes if method == "POST" and path.endswith(f"/{kind}")]
        assert len(posts) == 10, (kind, posts)
        assert all(path == f"/{group}/namespaces/{NAMESPACE}/{kind}" for path in posts)
    assert all(deployment_writes(cluster, name) == [] for name in names)  # created, never patched after
    assert not operator_process.bad_lines(), operator_process.bad_lines()


def test_deleting_a_resource_while_its_periodic_reconcile_is_stuck_takes_no_more_than_3_seconds(
    operator_process: OperatorProcess, cluster: Cluster, client: Client, redis_client: redis.Redis
) -> None:
    client.create(resource("slow", servedModelName="slow-model"))
    eventually(lambda: client.get("slow")["status"]["observedGeneration"] == 1)
    publish(redis_client, "slow-model", "slow-a", free=50)
    reconciled_periodically(cluster, "slow", 2)  # the handlers are done: the next read is the timer's
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/slow"
    cluster.delays[("GET", path)] = 60.0  # the timer's next read of the Deployment hangs
    eventually(lambda: ("GET", path) in cluster.delayed, timeout=10)

    started = time.monotonic()
    client.delete("slow")

    def gone() -> bool:
        try:
            client.get("slow")
        except Exception as error:  # the official client's 404
            return getattr(error, "status", None) == 404
        return False

    eventually(gone, timeout=10)
    assert time.monotonic() - started < 3
    assert redis_client.keys("pagefleet:replica:slow-model:*") == []


def test_sigterm_while_a_reconcile_is_stuck_exits_0_at_once_and_cleanly(
    operator_process: OperatorProcess, cluster: Cluster, client: Client
) -> None:
    client.create(resource("busy"))
    eventually(lambda: client.get("busy")["status"]["observedGeneration"] == 1)
    reconciled_periodically(cluster, "busy", 2)
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/busy"
    cluster.delays[("GET", path)] = 60.0
    eventually(lambda: ("GET", path) in cluster.delayed, timeout=10)
    started = time.monotonic()
    assert operator_process.stop() == 0
    assert time.monotonic() - started < 5
    # operator_process checks the log: nothing orphaned, no connection error.
