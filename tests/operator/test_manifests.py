"""What the operator builds, checked without a cluster: against the official Kubernetes
schemas (kubernetes-validate), the CRD's own schema (jsonschema) and the CEL rules' intent
(the pydantic spec)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from pagefleet.operator import manifests
from pagefleet.operator.settings import OperatorSettings
from pagefleet.operator.spec import InferenceDeploymentSpec, InvalidSpec, parse_spec
from tests.operator.cluster import CRD_PATH

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
K8S_VERSION = "1.37.0"
OWNER = manifests.Owner("smollm2", "models", "0b7c1d2e-1111-2222-3333-444455556666")


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())  # type: ignore[no-any-return]


def crd_validator() -> jsonschema.Draft4Validator:
    """The CRD's openAPIV3Schema as JSON Schema (OpenAPI 3.0 keeps draft-4's boolean
    exclusiveMinimum; the x-kubernetes-* keys are annotations to jsonschema)."""
    return jsonschema.Draft4Validator(crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())  # type: ignore[no-any-return]


SPECS: dict[str, dict[str, Any]] = {
    "minimal": {"model": {"builtin": "smollm2-135m-instruct"}},
    "gguf on a volume": {
        "model": {"gguf": "smol/model.gguf", "volume": {"claimName": "weights", "subPath": "v1"}},
        "engine": {"kvCacheMemory": "2Gi", "dtype": "bfloat16", "extraArgs": ["--seed", "1"]},
        "resources": {"cpu": "500m", "memory": "1Gi", "cpuLimit": 2, "memoryLimit": "2Gi"},
        "env": [
            {"name": "EXTRA", "value": "1"},
            {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
    },
    **{path.stem: example(path)["spec"] for path in EXAMPLES},
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_built_object_passes_the_official_schemas(name: str) -> None:
    spec = parse_spec(SPECS[name])
    secrets = OperatorSettings(
        engine_redis_url="redis://:$(REDIS_PASSWORD)@redis.pagefleet.svc:6379/0",
        engine_redis_password_secret="pagefleet-redis/password",
    )
    for settings in (OperatorSettings(), OperatorSettings(engine_redis_secret="redis/url"), secrets):
        for obj in manifests.desired_objects(OWNER, spec, settings):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_crd_passes_the_official_schema_and_every_example_passes_the_crd() -> None:
    kubernetes_validate.validate(crd(), K8S_VERSION, strict=True)
    validator = crd_validator()
    for path in EXAMPLES:
        body = example(path)
        validator.validate(body)
        parse_spec(body["spec"])
        assert body["apiVersion"] == manifests.API_VERSION and body["kind"] == manifests.KIND


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling"),
        ({"model": {"builtin": "smollm2-135m-instruct", "path": "/w"}}, "spec.model"),
        ({"model": {}}, "spec.model"),
        ({"model": {"builtin": "smollm2-135m-instruct", "volume": {"claimName": "c"}}}, "spec.model"),
        ({"disaggregation": {"decode": {"engine": {"blockSize": 32}}}}, "spec"),
        ({"disaggregation": {"prefill": {"engine": {"dtype": "bfloat16"}}}}, "spec"),
        ({"disaggregation": {}, "autoscaling": {"enabled": True}}, "spec"),
        ({"loraAdapters": [{"name": "a", "source": {"path": "/a"}}, {"name": "a", "source": {"path": "/b"}}]}, "spec"),
        (
            {"model": {"builtin": "smollm2-135m-instruct"}, "loraAdapters": [{"name": "a", "source": {"path": "a"}}]},
            "spec",
        ),
        (
            {"loraAdapters": [{"name": "a", "source": {"path": "/a", "pvc": {"claimName": "c"}}}]},
            "spec.loraAdapters.0.source",
        ),
        ({"loraAdapters": [{"name": "a", "source": {}}]}, "spec.loraAdapters.0.source"),
        ({"engine": {"tensorParallelSize": 4}, "resources": {"gpus": 2}}, "spec"),
        ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "spec.rollout"),
        ({"modelCache": {"claimName": "c", "hostPath": "/var/cache/models"}}, "spec.modelCache"),
        ({"modelCache": {}}, "spec.modelCache"),
        ({"kvCache": {"claimName": "c", "hostPath": "/var/cache/kv"}}, "spec.kvCache"),
    ],
)
def test_cel_rules_hold_in_pydantic_where_the_json_schema_alone_lets_them_pass(
    change: dict[str, Any], field: str
) -> None:
    body = example(EXAMPLES[0])
    body["spec"] |= change
    crd_validator().validate(body)  # structurally fine: only the CEL rule catches it
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(body["spec"])
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"replicas": -1}, "spec.replicas"),
        ({"engine": {"blockSize": 12}}, "spec.engine.blockSize"),
        ({"engine": {"kvCacheMemory": "lots"}}, "spec.engine.kvCacheMemory"),
        ({"autoscaling": {"targetKVUtilization": 0}}, "spec.autoscaling.targetKVUtilization"),
        ({"resources": {"memory": "3 gigs"}}, "spec.resources.memory"),
        ({"unknownField": 1}, "spec.unknownField"),
        ({"rollout": {"drainSeconds": -1}}, "spec.rollout.drainSeconds"),
    ],
)
def test_schema_violations_fail_both_the_crd_and_pydantic_naming_the_field(change: dict[str, Any], field: str) -> None:
    body = example(EXAMPLES[0])
    body["spec"] |= change
    if field != "spec.unknownField":  # the API server prunes unknown fields; the operator refuses them
        with pytest.raises(jsonschema.ValidationError):
            crd_validator().validate(body)
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(body["spec"])
    assert caught.value.field.startswith(field)


def _crd_properties(schema: dict[str, Any]) -> dict[str, Any]:
    return schema.get("properties", {})


def _compare(model: type[BaseModel], schema: dict[str, Any], path: str) -> None:
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    assert set(fields) == set(_crd_properties(schema)), path
    for alias, info in fields.items():
        prop = schema["properties"][alias]
        if "default" in prop:
            assert info.default == prop["default"], f"{path}.{alias}"
        nested = [t for t in getattr(info.annotation, "__args__", (info.annotation,)) if isinstance(t, type)]
        for kind in nested:
            if issubclass(kind, BaseModel) and prop.get("type") == "object":
                _compare(kind, prop, f"{path}.{alias}")


def test_the_pydantic_spec_mirrors_the_crd_field_for_field_with_the_same_defaults() -> None:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    _compare(InferenceDeploymentSpec, schema, "spec")


def test_engine_arguments_follow_the_spec() -> None:
    spec = parse_spec(copy.deepcopy(SPECS["gpu-autoscaling"]))
    args = manifests.engine_args(OWNER, spec, 8000)
    assert args[args.index("--model") + 1] == "/models/llama-3.2-1b"
    assert args[args.index("--kv-cache-memory") + 1] == "0.9"
    assert args[args.index("--device") + 1] == "cuda"
    deployment = manifests.deployment(OWNER, spec, OperatorSettings())
    limits = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    two_gib = parse_spec({"model": {"builtin": "smollm2-135m-instruct"}, "engine": {"kvCacheMemory": "2Gi"}})
    assert two_gib.engine.kv_cache_bytes_or_fraction == 2 * 2**30
    assert "--quantization" not in manifests.engine_args(OWNER, two_gib, 8000)  # auto: the engine decides
    dequantized = parse_spec({"model": {"builtin": "smollm2-135m-instruct"}, "engine": {"quantization": "none"}})
    args = manifests.engine_args(OWNER, dequantized, 8000)
    assert args[args.index("--quantization") + 1] == "none"


def test_the_rollout_reaches_the_strategy_the_drain_and_the_grace_period() -> None:
    spec = parse_spec({"model": {"builtin": "smollm2-135m-instruct"}, "rollout": {"maxSurge": 2, "drainSeconds": 120}})
    deployment = manifests.deployment(OWNER, spec, OperatorSettings())
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 2, "maxUnavailable": 0}
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--shutdown-timeout") + 1] == "120"
    assert pod["terminationGracePeriodSeconds"] == manifests.PRE_STOP_SECONDS + 120 + 10


@pytest.mark.parametrize(
    ("cache", "volume"),
    [
        (None, {"emptyDir": {}}),
        ({"claimName": "models-cache"}, {"persistentVolumeClaim": {"claimName": "models-cache"}}),
        (
            {"hostPath": "/var/cache/pagefleet"},
            {"hostPath": {"path": "/var/cache/pagefleet", "type": "DirectoryOrCreate"}},
        ),
    ],
)
def test_the_model_cache_is_the_pods_own_or_a_shared_volume(cache: dict[str, str] | None, volume: dict) -> None:
    body: dict[str, Any] = {"model": {"builtin": "smollm2-135m-instruct"}}
    if cache is not None:
        body["modelCache"] = cache
    deployment = manifests.deployment(OWNER, parse_spec(body), OperatorSettings())
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (cache_volume,) = [v for v in pod["volumes"] if v["name"] == "cache"]
    assert cache_volume == {"name": "cache", **volume}
    container = pod["containers"][0]
    assert {"name": "cache", "mountPath": "/var/cache/pagefleet"} in container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PAGEFLEET_CACHE_DIR"] == "/var/cache/pagefleet"


@pytest.mark.parametrize(
    ("tier", "volume"),
    [
        ({"size": "20Gi", "claimName": "kv-shared"}, {"persistentVolumeClaim": {"claimName": "kv-shared"}}),
        (
            {"size": "512Mi", "hostPath": "/var/cache/kv"},
            {"hostPath": {"path": "/var/cache/kv", "type": "DirectoryOrCreate"}},
        ),
        ({}, {"emptyDir": {"sizeLimit": "11264Mi"}}),
    ],
)
def test_the_kv_file_tier_is_mounted_and_named_to_the_engine(tier: dict[str, str], volume: dict) -> None:
    spec = parse_spec({"model": {"builtin": "smollm2-135m-instruct"}, "kvCache": tier})
    deployment = manifests.deployment(OWNER, spec, OperatorSettings())
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    pod = deployment["spec"]["template"]["spec"]
    (kv_volume,) = [v for v in pod["volumes"] if v["name"] == "kv-tier"]
    assert kv_volume == {"name": "kv-tier", **volume}
    container = pod["containers"][0]
    assert {"name": "kv-tier", "mountPath": "/var/cache/pagefleet-kv"} in container["volumeMounts"]
    args = container["args"]
    size = {"20Gi": "20", "512Mi": "0.5"}.get(tier.get("size", ""), "10")
    assert args[args.index("--kv-cache-dir") + 1 :][:3] == ["/var/cache/pagefleet-kv", "--kv-cache-dir-size-gib", size]


def test_without_kv_cache_there_is_no_file_tier() -> None:
    deployment = manifests.deployment(
        OWNER, parse_spec({"model": {"builtin": "smollm2-135m-instruct"}}), OperatorSettings()
    )
    assert "--kv-cache-dir" not in deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_disaggregated_spec_builds_one_deployment_per_pool_with_its_role() -> None:
    spec = parse_spec(
        {
            "model": {"builtin": "smollm2-135m-instruct"},
            "engine": {"blockSize": 32},
            "disaggregation": {"prefill": {"replicas": 2}, "decode": {"replicas": 3, "resources": {"cpu": "4"}}},
        }
    )
    objects = manifests.desired_objects(OWNER, spec, OperatorSettings())
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    assert set(deployments) == {"smollm2-prefill", "smollm2-decode"}
    for role, replicas in (("prefill", 2), ("decode", 3)):
        pod_set = deployments[f"smollm2-{role}"]
        assert pod_set["spec"]["replicas"] == replicas
        assert pod_set["spec"]["selector"]["matchLabels"][manifests.ROLE_LABEL] == role
        args = pod_set["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--role") + 1] == role
        assert args[args.index("--block-size") + 1] == "32"  # the spec's engine, shared by both pools
        kubernetes_validate.validate(pod_set, K8S_VERSION, strict=True)
    assert (
        deployments["smollm2-decode"]["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"]
        == "4"
    )
    # The Service and the PDB cover both pools.
    service = next(o for o in objects if o["kind"] == "Service")
    assert manifests.ROLE_LABEL not in service["spec"]["selector"]


def test_lora_adapters_become_engine_flags_and_read_only_volumes() -> None:
    spec = parse_spec(
        {
            "model": {"path": "base", "volume": {"claimName": "weights"}},
            "engine": {"maxLoras": 3, "maxLoraRank": 32},
            "loraAdapters": [
                {"name": "sql", "source": {"path": "adapters/sql"}},
                {"name": "chat", "source": {"path": "/opt/adapters/chat"}},
                {"name": "support", "source": {"pvc": {"claimName": "tunes", "path": "support-v2"}}},
            ],
        }
    )
    (pod_set,) = [o for o in manifests.desired_objects(OWNER, spec, OperatorSettings()) if o["kind"] == "Deployment"]
    kubernetes_validate.validate(pod_set, K8S_VERSION, strict=True)
    pod = pod_set["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--max-loras") + 1] == "3" and args[args.index("--max-lora-rank") + 1] == "32"
    assert "--enable-lora" in args
    modules = [args[i + 1] for i, arg in enumerate(args) if arg == "--lora-modules"]
    assert modules == ["sql=/models/adapters/sql", "chat=/opt/adapters/chat", "support=/adapters/support"]
    claim = next(v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "tunes")
    assert claim["persistentVolumeClaim"]["readOnly"] is True
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == claim["name"])
    assert mount == {"name": claim["name"], "mountPath": "/adapters/support", "readOnly": True, "subPath": "support-v2"}
    plain = parse_spec({"model": {"builtin": "smollm2-135m-instruct"}})
    (plain_set,) = [o for o in manifests.desired_objects(OWNER, plain, OperatorSettings()) if o["kind"] == "Deployment"]
    assert "--enable-lora" not in plain_set["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("tp", "gpus"), [(2, 0), (2, 2), (4, 4)])
def test_tensor_parallel_size_reaches_the_engine_on_cpus_and_within_the_gpus(tp: int, gpus: int) -> None:
    spec = parse_spec(
        {
            "model": {"builtin": "smollm2-135m-instruct"},
            "engine": {"tensorParallelSize": tp},
            "resources": {"gpus": gpus},
        }
    )
    (pod_set,) = [o for o in manifests.desired_objects(OWNER, spec, OperatorSettings()) if o["kind"] == "Deployment"]
    kubernetes_validate.validate(pod_set, K8S_VERSION, strict=True)
    args = pod_set["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == str(tp)
