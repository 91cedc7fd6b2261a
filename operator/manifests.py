"""The objects one InferenceDeployment becomes, built by pure functions.

Deployment (engine pods running `pagefleet serve`), Service and PodDisruptionBudget, all
labelled with the model and the resource and owned by the resource (deleting it deletes
them). Nothing here talks to the API: the reconciler applies what these return, and the
tests validate it against the official schemas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagefleet.operator.settings import OperatorSettings
from pagefleet.operator.spec import (
    ADAPTERS_MOUNT,
    MODELS_MOUNT,
    ROLES,
    InferenceDeploymentSpec,
    KVCacheTier,
    LoRAAdapter,
)

GROUP, VERSION, KIND, PLURAL = "pagefleet.io", "v1alpha1", "InferenceDeployment", "inferencedeployments"
API_VERSION = f"{GROUP}/{VERSION}"
NAME_LABEL = "pagefleet.io/inference-deployment"
MODEL_LABEL = "pagefleet.io/model"
ROLE_LABEL = "pagefleet.io/role"  # prefill or decode, on a disaggregated model's pools
MANAGED_BY = {"app.kubernetes.io/managed-by": "pagefleet-operator"}
_CACHE_MOUNT = "/var/cache/pagefleet"
KV_TIER_MOUNT = "/var/cache/pagefleet-kv"  # the KV file tier (spec.kvCache)
_STARTUP_SECONDS = 900  # converting a GGUF model or loading a large one takes minutes


@dataclass(frozen=True, slots=True)
class Owner:
    """The InferenceDeployment the objects belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: Any) -> Owner:
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"])

    @property
    def key(self) -> str:
        """namespace/name: how the operator keeps per-resource state in memory."""
        return f"{self.namespace}/{self.name}"

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def served_model_name(owner: Owner, spec: InferenceDeploymentSpec) -> str:
    return spec.served_model_name or owner.name


def label_value(text: str) -> str:
    """A label value for any served name (labels allow [A-Za-z0-9._-], at most 63 chars)."""
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:63]
    return cleaned.strip("._-") or "model"


def selector_labels(owner: Owner, role: str | None = None) -> dict[str, str]:
    """Every engine pod of the resource; with `role`, those of one pool."""
    return {NAME_LABEL: owner.name, "app.kubernetes.io/component": "engine"} | ({ROLE_LABEL: role} if role else {})


def deployment_name(owner: Owner, role: str | None = None) -> str:
    return f"{owner.name}-{role}" if role else owner.name


def deployment_names(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str | None, str]:
    """The engine Deployments the spec wants, by role (None: a colocated model's one)."""
    roles: tuple[str | None, ...] = ROLES if spec.disaggregation is not None else (None,)
    return {role: deployment_name(owner, role) for role in roles}


def labels(owner: Owner, spec: InferenceDeploymentSpec, role: str | None = None) -> dict[str, str]:
    return {
        **selector_labels(owner, role),
        MODEL_LABEL: label_value(served_model_name(owner, spec)),
        "app.kubernetes.io/name": "pagefleet-engine",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/part-of": "pagefleet",
        **MANAGED_BY,
    }


def selector_text(owner: Owner) -> str:
    """The label selector of the engine pods as text (status.selector, for `kubectl scale`/HPA)."""
    return ",".join(f"{key}={value}" for key, value in sorted(selector_labels(owner).items()))


def _metadata(owner: Owner, spec: InferenceDeploymentSpec, role: str | None = None) -> dict[str, Any]:
    return {
        "name": deployment_name(owner, role),
        "namespace": owner.namespace,
        "labels": labels(owner, spec, role),
        "ownerReferences": [owner.reference()],
    }


def engine_args(owner: Owner, spec: InferenceDeploymentSpec, port: int, role: str | None = None) -> list[str]:
    engine = spec.engine
    args = [
        "serve",
        "--model", spec.model.engine_argument,
        "--served-model-name", served_model_name(owner, spec),
        "--host", "0.0.0.0",
        "--port", str(port),
        "--advertise-url", f"http://$(POD_IP):{port}",  # the API server expands $(VAR) from env
        "--replica-id", "$(POD_NAME)",
        "--redis-url", "$(PAGEFLEET_REDIS_URL)",
        "--block-size", str(engine.block_size),
        "--max-num-seqs", str(engine.max_num_seqs),
        "--shutdown-timeout", str(spec.rollout.drain_seconds),
        "--enable-prompt-tokens-details",  # the gateway counts the cached prompt tokens replicas report
    ]  # fmt: skip
    if engine.dtype != "auto":
        args += ["--dtype", engine.dtype]
    if engine.quantization != "auto":
        args += ["--quantization", engine.quantization]
    if engine.kv_cache_memory is not None:
        args += ["--kv-cache-memory", repr(engine.kv_cache_bytes_or_fraction)]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if spec.resources.gpus:
        args += ["--device", "cuda"]
    if engine.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
    if role is not None:
        args += ["--role", role]
    if spec.kv_cache is not None:
        args += ["--kv-cache-dir", KV_TIER_MOUNT, "--kv-cache-dir-size-gib", f"{spec.kv_cache.size_gib:g}"]
    if spec.lora_adapters:
        args += ["--enable-lora", "--max-loras", str(engine.max_loras), "--max-lora-rank", str(engine.max_lora_rank)]
        for adapter in spec.lora_adapters:
            args += ["--lora-modules", f"{adapter.name}={adapter_path(adapter)}"]
    return args + list(engine.extra_args)


def adapter_path(adapter: LoRAAdapter) -> str:
    """Where an adapter's directory is inside the engine container."""
    source = adapter.source
    if source.pvc is not None:
        return f"{ADAPTERS_MOUNT}/{adapter.name}"
    assert source.path is not None, "the spec has one source per adapter"
    return source.path if source.path.startswith("/") else f"{MODELS_MOUNT}/{source.path}"


def _resources(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    wanted = spec.resources
    requests = {"cpu": wanted.cpu or "1", "memory": wanted.memory or "2Gi"}
    limits: dict[str, Any] = {"memory": wanted.memory_limit or requests["memory"]}
    if wanted.cpu_limit is not None:
        limits["cpu"] = wanted.cpu_limit
    if wanted.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = wanted.gpus
    return {"requests": requests, "limits": limits}


def _secret_ref(name_and_key: str, default_key: str) -> dict[str, Any]:
    secret, _, key = name_and_key.partition("/")
    return {"valueFrom": {"secretKeyRef": {"name": secret, "key": key or default_key}}}


def _redis_environment(settings: OperatorSettings) -> list[dict[str, Any]]:
    """PAGEFLEET_REDIS_URL: from a Secret, or a value that may say $(REDIS_PASSWORD), which
    the kubelet fills in from the password Secret (defined first, as expansion requires)."""
    env: list[dict[str, Any]] = []
    if settings.engine_redis_password_secret:
        env.append({"name": "REDIS_PASSWORD", **_secret_ref(settings.engine_redis_password_secret, "password")})
    if settings.engine_redis_secret:
        env.append({"name": "PAGEFLEET_REDIS_URL", **_secret_ref(settings.engine_redis_secret, "url")})
    else:
        env.append({"name": "PAGEFLEET_REDIS_URL", "value": settings.engine_redis_url or settings.redis_url})
    return env


def _environment(owner: Owner, spec: InferenceDeploymentSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *_redis_environment(settings),
        {"name": "PAGEFLEET_SERVED_MODEL_NAME", "value": served_model_name(owner, spec)},
        {"name": "PAGEFLEET_CACHE_DIR", "value": _CACHE_MOUNT},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
    ]
    if settings.engine_otlp_traces_endpoint:
        env += [
            {"name": "PAGEFLEET_ENGINE_OTLP_TRACES_ENDPOINT", "value": settings.engine_otlp_traces_endpoint},
            {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": settings.engine_otlp_traces_protocol},
        ]
    return env + [variable.model_dump(by_alias=True, exclude_none=True) for variable in spec.env]


PRE_STOP_SECONDS = 5  # the pause before SIGTERM, while Services and routers let the pod go
_STOP_MARGIN_SECONDS = 10  # after the drain: error answers go out, the engine and Redis record go away


def termination_grace_seconds(spec: InferenceDeploymentSpec) -> int:
    """How long Kubernetes waits before SIGKILL: the preStop pause, the engine's drain
    (`rollout.drainSeconds`, its --shutdown-timeout) and a margin to exit on its own."""
    return PRE_STOP_SECONDS + spec.rollout.drain_seconds + _STOP_MARGIN_SECONDS


def _probe(port: int, period: int, failures: int, path: str = "/health") -> dict[str, Any]:
    """`/health` answers while the replica is alive (draining too); `/ready` only while it
    takes new requests."""
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _cache_volume(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """Converted weights (the root filesystem stays read-only): each pod's own emptyDir, or
    `spec.modelCache`, shared, so that a model's second replica starts from the first's."""
    cache = spec.model_cache
    if cache is None:
        return {"name": "cache", "emptyDir": {}}
    if cache.claim_name is not None:
        return {"name": "cache", "persistentVolumeClaim": {"claimName": cache.claim_name}}
    return {"name": "cache", "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}


def _kv_tier_volume(tier: KVCacheTier) -> dict[str, Any]:
    """The KV file tier's directory: shared through a claim or a node's path, else the pod's
    own emptyDir (bounded a little above what the engine keeps it under)."""
    if tier.claim_name is not None:
        return {"name": "kv-tier", "persistentVolumeClaim": {"claimName": tier.claim_name}}
    if tier.host_path is not None:
        return {"name": "kv-tier", "hostPath": {"path": tier.host_path, "type": "DirectoryOrCreate"}}
    return {"name": "kv-tier", "emptyDir": {"sizeLimit": f"{math.ceil(tier.size_gib * 1.1 * 1024)}Mi"}}


def _volumes(spec: InferenceDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [_cache_volume(spec), {"name": "tmp", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [{"name": "cache", "mountPath": _CACHE_MOUNT}, {"name": "tmp", "mountPath": "/tmp"}]
    if spec.kv_cache is not None:
        volumes.append(_kv_tier_volume(spec.kv_cache))
        mounts.append({"name": "kv-tier", "mountPath": KV_TIER_MOUNT})
    source = spec.model.volume
    if source is not None:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": source.claim_name, "readOnly": True}})
        mount = {"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}
        mounts.append(mount | ({"subPath": source.sub_path} if source.sub_path else {}))
    for index, adapter in enumerate(spec.lora_adapters):
        claim = adapter.source.pvc
        if claim is None:
            continue
        volume = f"adapter-{index}"
        volumes.append({"name": volume, "persistentVolumeClaim": {"claimName": claim.claim_name, "readOnly": True}})
        mount = {"name": volume, "mountPath": adapter_path(adapter), "readOnly": True}
        mounts.append(mount | ({"subPath": claim.path} if claim.path else {}))
    if spec.resources.gpus:  # the engine's shared memory for CUDA IPC
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return volumes, mounts


def deployment(
    owner: Owner, spec: InferenceDeploymentSpec, settings: OperatorSettings, role: str | None = None
) -> dict[str, Any]:
    """The engine pods of a model, or with `role` of one pool of a disaggregated one (`spec`
    is then the pool's, see `InferenceDeploymentSpec.pool`)."""
    port = settings.engine_port
    volumes, mounts = _volumes(spec)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.image or settings.engine_image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": engine_args(owner, spec, port, role),
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        "env": _environment(owner, spec, settings),
        "resources": _resources(spec),
        "startupProbe": _probe(port, period=5, failures=_STARTUP_SECONDS // 5),
        "readinessProbe": _probe(port, period=5, failures=2, path="/ready"),
        # Endpoints and Services drop the pod before the engine starts draining.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}},
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if settings.liveness_probe:
        container["livenessProbe"] = _probe(port, period=10, failures=6)
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "enableServiceLinks": False,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, spec, role),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(owner, role)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": spec.rollout.max_surge, "maxUnavailable": spec.rollout.max_unavailable},
            },
            "template": {"metadata": {"labels": labels(owner, spec, role)}, "spec": pod_spec},
        },
    }


def service(owner: Owner, spec: InferenceDeploymentSpec, settings: OperatorSettings) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, spec),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(owner),
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(owner: Owner, spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """At most one engine pod down at a time for voluntary disruptions (node drains)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner, spec),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner)}},
    }


def desired_objects(owner: Owner, spec: InferenceDeploymentSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    """The Deployment (one per pool when disaggregated), then the Service and the PDB that
    cover every engine pod of the resource."""
    deployments = [
        deployment(owner, spec.pool(role) if role else spec, settings, role) for role in deployment_names(owner, spec)
    ]
    return [*deployments, service(owner, spec, settings), pod_disruption_budget(owner, spec)]
