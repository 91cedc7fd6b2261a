"""A Kubernetes API server for the operator's tests: KMock's emulator, with the CRD loaded
and the few API-server duties the operator relies on, served over real HTTP from a thread.

KMock stores objects and merges patches; a real API server also stamps uid and generation,
names objects created with generateName, keeps `.status` apart from the rest (the status
subresource) and maps the scale subresource onto `.spec.replicas`. `Cluster` adds just
those, logs every write so tests can assert that a reconcile made none, and can answer 503
or answer late on demand.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import threading
import uuid
from pathlib import Path
from typing import Any

import kmock
import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "inferencedeployments.pagefleet.io.yaml"
WRITE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}

BUILTIN_RESOURCES = {
    "apps/v1/deployments": kmock.ResourceInfo(kind="Deployment", namespaced=True, subresources={"status", "scale"}),
    "v1/services": kmock.ResourceInfo(kind="Service", namespaced=True, subresources={"status"}),
    "policy/v1/poddisruptionbudgets": kmock.ResourceInfo(kind="PodDisruptionBudget", namespaced=True),
    "v1/events": kmock.ResourceInfo(kind="Event", namespaced=True),
    "v1/namespaces": kmock.ResourceInfo(kind="Namespace", namespaced=False),  # kopf waits for both in discovery
    "apiextensions.k8s.io/v1/customresourcedefinitions": kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False
    ),
}


def crd_resource() -> tuple[str, kmock.ResourceInfo]:
    """The discovery entry of the CRD, read from the CRD file itself."""
    crd = yaml.safe_load(CRD_PATH.read_text())
    names, version = crd["spec"]["names"], crd["spec"]["versions"][0]
    info = kmock.ResourceInfo(
        kind=names["kind"],
        singular=names["singular"],
        namespaced=crd["spec"]["scope"] == "Namespaced",
        shortnames=set(names.get("shortNames", [])),
        subresources=set(version.get("subresources", {})),
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
    )
    return f"{crd['spec']['group']}/{version['name']}/{names['plural']}", info


class Cluster(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.writes: list[tuple[str, str]] = []  # (method, path) of every write
        self.failures: dict[tuple[str, str], int] = {}  # (method, path): answer 503 this many times
        self.delays: dict[tuple[str, str], float] = {}  # (method, path): answer the next such call this late
        self.delayed: list[tuple[str, str]] = []  # calls that were held back, once their wait began
        self.operator_calls: set[tuple[str, str, str]] = set()  # (group, resource, verb) the operator used
        self.operator_reads: list[str] = []  # path of every GET the operator made, in order

    async def _handle(self, request: kmock.Request) -> Any:
        method = str(request.method.value).upper()
        agent = request.headers.get("User-Agent", "")
        if agent.startswith(("kopf/", "pagefleet-operator")):
            self.operator_calls.update(_rbac_terms(method, request.url.path, dict(request.params)))
            if method == "GET":
                self.operator_reads.append(request.url.path)
        if method in WRITE_METHODS:
            self.writes.append((method, request.url.path))
        delay = self.delays.pop((method, request.url.path), None)
        if delay is not None:  # a slow API server, once
            self.delayed.append((method, request.url.path))
            await asyncio.sleep(delay)
        if self.failures.get((method, request.url.path), 0) > 0:
            self.failures[(method, request.url.path)] -= 1
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="injected by the test")
        if request.resource is not None and isinstance(request.data, dict):
            object.__setattr__(request, "data", self._as_api_server(request))
        return await super()._handle(request)

    def _as_api_server(self, request: kmock.Request) -> dict[str, Any]:
        data = copy.deepcopy(request.data)
        if request.action == kmock.action.CREATE:
            meta = data.setdefault("metadata", {})
            meta.setdefault("namespace", request.namespace)
            if "name" not in meta and "generateName" in meta:  # kopf's events
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta["uid"] = str(uuid.uuid4())
            meta["generation"] = 1
            meta["resourceVersion"] = "1"  # kept: kopf's JSON patches test it, and KMock answers a
            # failed test with 500 where a real server says 409 and kopf would re-read
            meta["creationTimestamp"] = datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            return data
        if request.action != kmock.action.UPDATE or request.name is None:
            return data
        key = (request.resource, request.namespace, request.name)
        current = self.objects[key].raw if key in self.objects and not self.objects[key].deleted else {}
        meta = current.get("metadata", {})
        if request.subresource == "status":
            return {"status": data.get("status")}
        if request.subresource == "scale":
            data = {"spec": {"replicas": data["spec"]["replicas"]}}
        else:
            data.pop("status", None)  # the main resource ignores status (it has a subresource)
        spec_changes = data.get("spec")
        merged_meta = data.setdefault("metadata", {})
        if spec_changes is not None and _merge(current.get("spec", {}), spec_changes) != current.get("spec", {}):
            merged_meta["generation"] = meta.get("generation", 1) + 1
        return data


def _rbac_terms(method: str, path: str, params: dict[str, str]) -> list[tuple[str, str, str]]:
    """(API group, resource[/subresource], verb) of a call, as RBAC rules name it; none for
    discovery, which every authenticated client may read."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return []
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    if not rest:  # /api/v1, discovery
        return []
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    if method == "GET":
        verb = "get" if name else ("watch" if params.get("watch") in ("true", "1") else "list")
    else:
        verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[method]
    return [(group, f"{resource}/{sub}" if sub else resource, verb)]


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return patch
    merged = dict(base)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge(base.get(key), value)
    return merged


class ApiServer:
    """`Cluster` on a free port, in its own thread and event loop."""

    def __init__(self) -> None:
        self.cluster: Cluster | None = None
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with Cluster() as cluster, kmock.Server(cluster) as server:
            for name, info in BUILTIN_RESOURCES.items():
                cluster.resources[name] = info
            name, info = crd_resource()
            cluster.resources[name] = info
            self.cluster, self.url = cluster, str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def start(self) -> ApiServer:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the KMock API server did not start")
        return self

    def stop(self) -> None:
        assert self._stop is not None, "start() first"
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def kubeconfig(self) -> str:
        return yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
                "users": [{"name": "tester", "user": {"token": "test-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}],
                "current-context": "kmock",
            }
        )
