"""The operator against a KMock Kubernetes API and a real Redis: objects, status, updates,
deletion, invalid specs, autoscaling."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from pagefleet.operator.settings import OperatorSettings
from pagefleet.protocol.demand import demand_key, scalable_key
from pagefleet.protocol.replica import RECORD_TTL_S, ReplicaRecord, record_key
from tests.operator.cluster import Cluster
from tests.operator.conftest import NAMESPACE, Client, eventually


def resource(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pagefleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"model": {"builtin": "smollm2-135m-instruct"}, **spec},
    }


def condition(body: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [c for c in body.get("status", {}).get("conditions", []) if c["type"] == kind]
    assert found, f"no {kind} condition yet"
    return found[0]


def publish(client: redis.Redis, model: str, replica_id: str, free: int, total: int = 100, waiting: int = 0) -> None:
    record = ReplicaRecord(
        replica_id=replica_id, model=model, url=f"http://{replica_id}:8000", free_blocks=free,
        total_blocks=total, block_size=16, running=1, waiting=waiting, max_model_len=2048,
    )  # fmt: skip
    client.set(record_key(model, replica_id), record.model_dump_json(), px=60_000)


@contextmanager
def live_replicas(client: redis.Redis, model: str) -> Iterator[Callable[[str, int, int], None]]:
    """Replicas that publish their records several times within RECORD_TTL_S, as running
    engines do: a record published once goes stale while a slow test still reads it. Yields
    `replica(replica_id, free_blocks, waiting)`, which publishes at once and keeps it fresh."""
    replicas: dict[str, tuple[int, int]] = {}
    stop = threading.Event()

    def replica(replica_id: str, free: int, waiting: int) -> None:
        publish(client, model, replica_id, free=free, waiting=waiting)
        replicas[replica_id] = (free, waiting)

    def refresh() -> None:
        while not stop.wait(RECORD_TTL_S / 6):
            for replica_id, (free, waiting) in list(replicas.items()):
                publish(client, model, replica_id, free=free, waiting=waiting)

    thread = threading.Thread(target=refresh, daemon=True)
    thread.start()
    try:
        yield replica
    finally:
        stop.set()
        thread.join()


def test_a_resource_becomes_a_deployment_service_and_pdb_owned_by_it(
    operator: OperatorSettings, client: Client, cluster: Cluster
) -> None:
    client.create(resource("smollm2", servedModelName="smol", replicas=2, engine={"maxNumSeqs": 32}))
    deployment = eventually(lambda: client.deployment("smollm2"))
    uid = client.get("smollm2")["metadata"]["uid"]
    owner = {"apiVersion": "pagefleet.io/v1alpha1", "kind": "InferenceDeployment", "name": "smollm2", "uid": uid}

    assert deployment["metadata"]["ownerReferences"] == [owner | {"controller": True, "blockOwnerDeletion": True}]
    assert deployment["metadata"]["labels"]["pagefleet.io/model"] == "smol"
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == operator.engine_image
    args = container["args"]
    assert args[:5] == ["serve", "--model", "smollm2-135m-instruct", "--served-model-name", "smol"]
    assert args[args.index("--max-num-seqs") + 1] == "32"
    assert args[args.index("--redis-url") + 1] == "$(PAGEFLEET_REDIS_URL)"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PAGEFLEET_REDIS_URL"] == operator.redis_url
    assert env["PAGEFLEET_SERVED_MODEL_NAME"] == "smol"
    for probe in ("livenessProbe", "startupProbe"):  # alive while it drains too
        assert container[probe]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"  # not while it drains
    # A rollout never drops below the current capacity, and a stopping pod drains: the
    # preStop pause, then 30 s for requests in flight, within the grace period.
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert args[args.index("--shutdown-timeout") + 1] == "30"
    assert pod["terminationGracePeriodSeconds"] == 5 + 30 + 10
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    service = client.core.read_namespaced_service("smollm2", NAMESPACE, _preload_content=False).json()
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["metadata"]["ownerReferences"][0]["uid"] == uid
    pdb = client.policy.read_namespaced_pod_disruption_budget("smollm2", NAMESPACE, _preload_content=False).json()
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == uid

    def handled() -> dict[str, Any] | None:
        """The resource once kopf has written both its status and its bookkeeping
        annotations (two patches: a slow machine can be read between them)."""
        current = client.get("smollm2")
        return current if "status" in current and current["metadata"].get("annotations") else None

    body = eventually(handled)
    assert body["status"]["servedModelName"] == "smol"
    assert body["status"]["readyText"] == "0/2"
    assert condition(body, "Ready")["status"] == "False"
    assert condition(body, "KVCachePressure")["reason"] == "NoReports"
    # kopf's bookkeeping lives in pagefleet.io annotations, not in .status, plus our finalizer
    assert body["metadata"]["finalizers"] == ["pagefleet.io/finalizer"]
    annotations = body["metadata"].get("annotations", {})
    assert annotations and all(key.startswith("pagefleet.io/") for key in annotations)
    assert set(body["status"]) <= {
        "observedGeneration", "servedModelName", "replicas", "readyReplicas", "readyText", "selector", "kv",
        "conditions", "lastScaleTime",
    }  # fmt: skip


def test_a_spec_change_rolls_through_and_status_follows_the_deployment_and_redis(
    operator: OperatorSettings, client: Client, cluster: Cluster, redis_client: redis.Redis
) -> None:
    client.create(resource("smol", replicas=1))
    eventually(lambda: client.deployment("smol"))
    client.patch("smol", {"spec": {"replicas": 2, "engine": {"dtype": "bfloat16"}, "resources": {"memory": "6Gi"}}})

    def rolled() -> dict[str, Any]:
        deployment = client.deployment("smol")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert deployment["spec"]["replicas"] == 2
        assert container["args"][container["args"].index("--dtype") + 1] == "bfloat16"
        assert container["resources"]["requests"]["memory"] == "6Gi"
        return deployment

    eventually(rolled)
    # The cluster brings the pods up; their records reach Redis.
    client.apps.patch_namespaced_deployment_status(
        "smol",
        NAMESPACE,
        {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 2}},
    )
    publish(redis_client, "smol", "smol-a", free=20)
    publish(redis_client, "smol", "smol-b", free=40, waiting=3)

    def status() -> dict[str, Any]:
        body = client.get("smol")
        assert body["status"]["observedGeneration"] == body["metadata"]["generation"] == 2
        assert body["status"]["readyText"] == "2/2"
        assert body["status"]["kv"] == {
            "freeBlocks": 60, "totalBlocks": 200, "utilization": 0.7, "utilizationText": "70%",
            "waitingRequests": 3, "reportingReplicas": 2,
        }  # fmt: skip
        return body

    body = eventually(status)
    assert condition(body, "Ready")["reason"] == "AllReplicasReady"
    assert condition(body, "Progressing")["status"] == "False"
    assert condition(body, "Degraded")["status"] == "False"
    assert condition(body, "KVCachePressure")["reason"] == "RequestsWaiting"


def test_a_second_reconcile_writes_nothing(
    api_server: Any, client: Client, cluster: Cluster, redis_server: Any
) -> None:
    from pagefleet.operator.kube import INFERENCE_DEPLOYMENTS, KubeApi
    from pagefleet.operator.main import _login
    from pagefleet.operator.reconcile import Runtime, reconcile
    from tests.operator.conftest import operator_settings

    client.create(resource("quiet", nodeSelector={"pool": "cpu"}))

    async def twice() -> tuple[list[str], list[str], dict[str, Any], int]:
        import redis.asyncio as aioredis

        runtime = Runtime(operator_settings(redis_server.url), KubeApi(_login), aioredis.from_url(redis_server.url))
        try:
            first = await reconcile(runtime, client.get("quiet"))
            await runtime.kube.patch(
                INFERENCE_DEPLOYMENTS, NAMESPACE, "quiet", {"status": first.status_patch}, "status"
            )
            writes = len(cluster.writes)
            second = await reconcile(runtime, client.get("quiet"))
            return first.applied, second.applied, second.status_patch, len(cluster.writes) - writes
        finally:
            await runtime.kube.close()
            await runtime.redis.aclose()

    import asyncio

    first, second, status_patch, writes = asyncio.run(twice())
    assert first == [f"created {kind} {NAMESPACE}/quiet" for kind in ("Deployment", "Service", "PodDisruptionBudget")]
    assert second == [] and status_patch == {} and writes == 0


def test_an_invalid_spec_says_which_field_and_creates_nothing(
    operator: OperatorSettings, client: Client, cluster: Cluster
) -> None:
    client.create(resource("broken", autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2}))

    def refused() -> dict[str, Any]:
        ready = condition(client.get("broken"), "Ready")
        assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
        return ready

    ready = eventually(refused)
    assert "spec.autoscaling" in ready["message"] and "minReplicas" in ready["message"]
    events = eventually(lambda: [e for e in cluster.objects.values() if e.get("reason") == "InvalidSpec"])
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "broken"
    assert ("POST", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments") not in cluster.writes
    # No crash loop: the operator goes on serving other resources, and the fixed one.
    client.patch("broken", {"spec": {"autoscaling": {"minReplicas": 1}}})
    eventually(lambda: client.deployment("broken"))
    eventually(lambda: condition(client.get("broken"), "Ready")["reason"] == "ReplicasNotReady")


def test_deletion_removes_the_models_records_from_redis_then_the_resource(
    operator: OperatorSettings, client: Client, redis_client: redis.Redis
) -> None:
    client.create(resource("gone", servedModelName="gone-model"))
    eventually(lambda: client.get("gone")["metadata"].get("finalizers"))
    publish(redis_client, "gone-model", "r1", free=10)
    publish(redis_client, "other-model", "r1", free=10)
    client.delete("gone")

    def deleted() -> bool:
        try:
            client.get("gone")
        except Exception as error:  # the official client's 404
            return getattr(error, "status", None) == 404
        return False

    eventually(deleted)
    assert redis_client.keys("pagefleet:replica:gone-model:*") == []
    assert redis_client.keys("pagefleet:replica:other-model:*") != []


def wait_for_reconciles(cluster: Cluster, name: str, count: int, operator: OperatorSettings) -> None:
    """Until the periodic reconcile has run `count` more times for `name` (each run reads its
    Deployment): the positive signal that lets a test assert something did not happen."""
    path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}"
    before = cluster.operator_reads.count(path)
    eventually(
        lambda: cluster.operator_reads.count(path) >= before + count,
        timeout=(count + 2) * operator.reconcile_interval_s + 5,
    )


def test_kv_pressure_scales_up_within_one_period_through_the_scale_subresource(
    operator: OperatorSettings, client: Client, cluster: Cluster, redis_client: redis.Redis
) -> None:
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetKVUtilization": 0.5}
    with live_replicas(redis_client, "busy") as replica:
        replica("busy-a", 5, 0)  # 95% used against a target of 50%
        client.create(resource("busy", replicas=1, autoscaling=autoscaling))
        eventually(lambda: client.get("busy")["spec"]["replicas"] == 2, timeout=3 * operator.reconcile_interval_s + 2)
        assert any(path.endswith("/inferencedeployments/busy/scale") for _, path in cluster.writes)
        eventually(lambda: client.deployment("busy")["spec"]["replicas"] == 2)
        events = eventually(lambda: [e for e in cluster.objects.values() if e.get("reason") == "ScaledUp"])
        assert "1 -> 2 replicas" in events[0]["message"]
        # Never past maxReplicas, however high the pressure.
        replica("busy-b", 0, 10)
        eventually(lambda: client.get("busy")["spec"]["replicas"] == 3)
        replica("busy-c", 0, 10)
        wait_for_reconciles(cluster, "busy", 2, operator)
        assert client.get("busy")["spec"]["replicas"] == 3
        # What the autoscaler saw and did, on the operator's /metrics (the chart's ServiceMonitor scrapes it).
        busy = {"namespace": NAMESPACE, "name": "busy"}
        desired = ("pagefleet_operator:desired_replicas", frozenset({**busy, "pool": ""}.items()))
        figures = eventually(lambda: (found := operator_metrics(operator))[desired] == 3 and found)
    utilization = figures["pagefleet_operator:kv_utilization", frozenset({**busy, "pool": ""}.items())]
    assert utilization == pytest.approx((0.95 + 1 + 1) / 3)
    scaled_up = frozenset({**busy, "pool": "", "reason": "ScaledUp"}.items())
    assert figures["pagefleet_operator:scaling_events_total", scaled_up] == 2
    assert figures["pagefleet_operator:reconciles_total", frozenset({**busy, "result": "ok"}.items())] >= 3
    client.delete("busy")
    eventually(lambda: not any(("name", "busy") in labels for _, labels in operator_metrics(operator)), timeout=30)


def operator_metrics(operator: OperatorSettings) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(name, labels) -> value, from the operator's Prometheus endpoint."""
    text = httpx.get(f"http://127.0.0.1:{operator.metrics_port}/metrics").text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_without_autoscaling_the_operator_never_writes_replicas(
    operator: OperatorSettings, client: Client, cluster: Cluster, redis_client: redis.Redis
) -> None:
    publish(redis_client, "manual", "manual-a", free=0, waiting=5)
    client.create(resource("manual", replicas=1))
    eventually(lambda: client.deployment("manual"))
    client.patch("manual", {"spec": {"replicas": 4}})  # an HPA or `kubectl scale`
    eventually(lambda: client.deployment("manual")["spec"]["replicas"] == 4)
    wait_for_reconciles(cluster, "manual", 2, operator)
    assert client.get("manual")["spec"]["replicas"] == 4
    assert not any(path.endswith("/scale") for _, path in cluster.writes)


def test_transient_api_errors_are_retried_with_backoff(
    operator: OperatorSettings, client: Client, cluster: Cluster
) -> None:
    create = ("POST", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments")
    cluster.failures[create] = 2
    client.create(resource("flaky"))
    eventually(lambda: client.deployment("flaky"), timeout=20)
    assert cluster.writes.count(create) == 3


def test_low_pressure_scales_down_only_after_the_window_and_never_below_min(
    operator: OperatorSettings, client: Client, cluster: Cluster, redis_client: redis.Redis
) -> None:
    window_s = 4
    autoscaling = {
        "enabled": True, "minReplicas": 2, "maxReplicas": 5, "targetKVUtilization": 0.6,
        "scaleDownStabilizationWindowSeconds": window_s,
    }  # fmt: skip

    def idle_replicas_report() -> None:  # 5% used against a target of 60%; records live 3 s
        for replica in ("idle-a", "idle-b", "idle-c", "idle-d"):
            publish(redis_client, "idle", replica, free=95)

    def replicas_after_report() -> int:
        idle_replicas_report()
        return int(client.get("idle")["spec"]["replicas"])

    idle_replicas_report()
    client.create(resource("idle", replicas=4, autoscaling=autoscaling))
    created = time.monotonic()
    eventually(lambda: replicas_after_report() == 2, timeout=window_s + 5 * operator.reconcile_interval_s)
    assert time.monotonic() - created >= window_s  # not before the whole window was watched
    assert [e["message"] for e in cluster.objects.values() if e.get("reason") == "ScaleDownStabilizing"]
    scaled = eventually(lambda: [e["message"] for e in cluster.objects.values() if e.get("reason") == "ScaledDown"])
    assert len(scaled) == 1 and scaled[0].startswith("4 -> 2 replicas")  # to minReplicas, not below
    wait_for_reconciles(cluster, "idle", 2, operator)
    assert replicas_after_report() == 2


def test_an_idle_model_with_min_replicas_0_scales_to_zero_and_a_request_brings_it_back(
    operator: OperatorSettings, client: Client, cluster: Cluster, redis_client: redis.Redis
) -> None:
    autoscaling = {"enabled": True, "minReplicas": 0, "maxReplicas": 2, "idleSeconds": 2}
    client.create(resource("lazy", replicas=1, autoscaling=autoscaling))
    # The routers learn that it may have no replica (they hold its requests, not 404).
    eventually(lambda: redis_client.exists(scalable_key("lazy")))
    publish(redis_client, "lazy", "lazy-a", free=50)
    eventually(lambda: client.get("lazy")["spec"]["replicas"] == 0, timeout=2 + 4 * operator.reconcile_interval_s)
    eventually(lambda: client.deployment("lazy")["spec"]["replicas"] == 0)
    redis_client.delete(record_key("lazy", "lazy-a"))
    wait_for_reconciles(cluster, "lazy", 2, operator)
    assert client.get("lazy")["spec"]["replicas"] == 0, "nothing asked for it: it stays at zero"
    redis_client.set(demand_key("lazy"), repr(time.time()))  # what a router holding a request writes
    eventually(lambda: client.get("lazy")["spec"]["replicas"] == 1, timeout=3 * operator.reconcile_interval_s + 2)
    # The event follows the patch (kopf posts it afterwards): wait for it, do not race it.
    eventually(lambda: {"ScaledToZero", "ScaledUpFromZero"} <= {e.get("reason") for e in cluster.objects.values()})
    client.delete("lazy")
    eventually(lambda: not redis_client.exists(scalable_key("lazy")))


def publish_role(
    client: redis.Redis, model: str, replica_id: str, role: str, free: int, prompt_tokens: int = 0
) -> None:
    record = ReplicaRecord(
        replica_id=replica_id, model=model, url=f"http://{replica_id}:8000", free_blocks=free, total_blocks=100,
        block_size=16, running=1, waiting=0, max_model_len=2048, role=role, waiting_prompt_tokens=prompt_tokens,
    )  # fmt: skip
    client.set(record_key(model, replica_id), record.model_dump_json(), px=60_000)


def test_a_disaggregated_model_becomes_two_pools_and_back(
    operator: OperatorSettings, client: Client, cluster: Cluster, redis_client: redis.Redis
) -> None:
    publish_role(redis_client, "pd", "pd-p", "prefill", free=90, prompt_tokens=300)
    publish_role(redis_client, "pd", "pd-d", "decode", free=40)
    pools = {"prefill": {"replicas": 1}, "decode": {"replicas": 2, "resources": {"cpu": "3", "memory": "4Gi"}}}
    client.create(resource("pd", resources={"cpu": "1"}, disaggregation=pools))
    prefill = eventually(lambda: client.deployment("pd-prefill"))
    decode = eventually(lambda: client.deployment("pd-decode"))
    for pod_set, role, replicas in ((prefill, "prefill", 1), (decode, "decode", 2)):
        assert pod_set["spec"]["replicas"] == replicas
        assert pod_set["spec"]["selector"]["matchLabels"]["pagefleet.io/role"] == role
        assert pod_set["spec"]["template"]["metadata"]["labels"]["pagefleet.io/role"] == role
        args = pod_set["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--role") + 1] == role
    resources = decode["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == "3"
    assert prefill["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "1"
    status = eventually(lambda: client.get("pd")["status"].get("pools"))
    assert status["prefill"]["waitingPromptTokens"] == 300
    assert status["decode"]["kv"]["freeBlocks"] == 40
    assert status["prefill"]["readyText"] == "0/1" and status["decode"]["readyText"] == "0/2"
    assert client.get("pd")["status"]["readyText"] == "0/3"
    # Back to one colocated Deployment: the pools go.
    client.patch("pd", {"spec": {"disaggregation": None}})
    eventually(lambda: client.deployment("pd"))

    def pools_gone() -> bool:
        for name in ("pd-prefill", "pd-decode"):
            try:
                client.deployment(name)
                return False
            except Exception as error:  # the official client's 404
                if getattr(error, "status", None) != 404:
                    raise
        return True

    eventually(pools_gone)


def test_the_prefill_pool_scales_on_queued_prompt_tokens(
    operator: OperatorSettings, client: Client, cluster: Cluster, redis_client: redis.Redis
) -> None:
    publish_role(redis_client, "pdq", "pdq-p", "prefill", free=90, prompt_tokens=9000)
    publish_role(redis_client, "pdq", "pdq-d", "decode", free=90)
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetWaitingPromptTokens": 3000}
    pools = {"prefill": {"replicas": 1, "autoscaling": autoscaling}, "decode": {"replicas": 1}}
    client.create(resource("pdq", disaggregation=pools))
    wanted = 3  # 9000 queued prompt tokens on one replica against 3000 per replica
    eventually(
        lambda: client.get("pdq")["spec"]["disaggregation"]["prefill"]["replicas"] == wanted,
        timeout=3 * operator.reconcile_interval_s + 2,
    )
    eventually(lambda: client.deployment("pdq-prefill")["spec"]["replicas"] == wanted)
    assert client.get("pdq")["spec"]["disaggregation"]["decode"]["replicas"] == 1


def test_the_status_lists_the_adapters_each_pool_serves(
    operator: OperatorSettings, client: Client, redis_client: redis.Redis
) -> None:
    for replica_id, adapters in (("tuned-0", ["sql"]), ("tuned-1", ["sql", "support"])):
        record = ReplicaRecord(
            replica_id=replica_id, model="tuned", url=f"http://{replica_id}:8000", free_blocks=50,
            total_blocks=100, block_size=16, running=0, waiting=0, max_model_len=2048, adapters=adapters,
        )  # fmt: skip
        redis_client.set(record_key("tuned", replica_id), record.model_dump_json(), px=60_000)
    adapters = [{"name": name, "source": {"path": f"/opt/adapters/{name}"}} for name in ("sql", "support")]
    client.create(resource("tuned", loraAdapters=adapters))
    args = eventually(lambda: client.deployment("tuned"))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--lora-modules"] == [
        "sql=/opt/adapters/sql",
        "support=/opt/adapters/support",
    ]
    status = eventually(lambda: client.get("tuned")["status"].get("adapters"))
    assert status == {"engine": ["sql", "support"]}
