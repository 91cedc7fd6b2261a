"""The Helm chart, rendered by a real helm (scripts/fetch-helm.sh) with several value sets:
lint, the objects, the official Kubernetes schemas, values.schema.json, RBAC against the
operator's own table of API calls."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pagefleet.gateway.settings import PickerSettings
from pagefleet.operator.kube import PERMISSIONS
from pagefleet.operator.manifests import Owner, labels
from pagefleet.operator.settings import OperatorSettings
from pagefleet.operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagefleet"
HELM = ROOT / ".tools" / "helm"
K8S_VERSION = "1.37.0"
NAMESPACE = "pagefleet"


def helm(*args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess[str]:
    """Run helm; `values` go in as a values file on stdin."""
    if not HELM.exists():
        pytest.fail(f"{HELM} is missing: bash scripts/fetch-helm.sh (scripts/test.sh runs it)")
    stdin = None if values is None else json.dumps(values)
    extra = [] if values is None else ["--values", "-"]
    return subprocess.run([str(HELM), *args, *extra], input=stdin, capture_output=True, text=True, timeout=120)


def render(values: dict[str, Any] | None = None, release: str = "pf", crds: bool = False) -> list[dict[str, Any]]:
    flags = ["--include-crds"] if crds else []
    result = helm("template", release, str(CHART), "--namespace", NAMESPACE, *flags, values=values or {})
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_error(values: dict[str, Any]) -> str:
    result = helm("template", "pf", str(CHART), values=values)
    assert result.returncode != 0, "helm accepted bad values"
    return result.stderr


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def kinds(docs: list[dict[str, Any]]) -> list[str]:
    return sorted(d["kind"] for d in docs)


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def inference_pool_validator() -> jsonschema.Draft7Validator:
    schema = json.loads((Path(__file__).parent / "inferencepool-v1.schema.json").read_text())
    return jsonschema.Draft7Validator(schema)


def monitoring_validator() -> jsonschema.Draft7Validator:
    """ServiceMonitor and PodMonitor, as the Prometheus Operator's API reference defines them."""
    schema = json.loads((Path(__file__).parent / "monitoring-v1.schema.json").read_text())
    return jsonschema.Draft7Validator(schema)


def crd_validator() -> jsonschema.Draft4Validator:
    crd = yaml.safe_load((ROOT / "crds" / "inferencedeployments.pagefleet.io.yaml").read_text())
    return jsonschema.Draft4Validator(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


FIRST_MODEL = {
    "name": "smollm2",
    "spec": {"model": {"builtin": "smollm2-135m-instruct"}, "replicas": 2, "engine": {"maxNumSeqs": 32}},
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external redis": {"redis": {"enabled": False, "external": {"url": "rediss://:secret@redis.example:6380/0"}}},
    "external redis from a secret": {"redis": {"enabled": False, "external": {"existingSecret": "my-redis"}}},
    "gateway autoscaling and ingress": {
        "gateway": {
            "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12},
            "ingress": {"enabled": True, "className": "nginx", "tls": {"enabled": True, "secretName": "tls"}},
        }
    },
    "a first model": {"models": [FIRST_MODEL]},
    "a disaggregated model": {
        "models": [
            {
                "name": "smollm2-pd",
                "spec": yaml.safe_load((ROOT / "examples" / "smollm2-disaggregated.yaml").read_text())["spec"],
            }
        ]
    },
    "api keys from an existing secret": {"gateway": {"apiKeys": {"enabled": True, "existingSecret": "keys"}}},
    "api keys created by the chart": {
        "gateway": {
            "apiKeys": {"enabled": True, "keys": ["sk-first-key", "sk-second-key"]},
            "rateLimits": {"requestsPerMinute": 60},
        }
    },
    "the picker, with a first model": {"picker": {"enabled": True, "failureMode": "FailOpen"}, "models": [FIRST_MODEL]},
    "metrics: monitors and dashboards": {
        "picker": {"enabled": True},
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "grafanaDashboards": {"enabled": True, "annotations": {"grafana_folder": "pagefleet"}},
        },
        "models": [FIRST_MODEL],
    },
    "tracing": {"tracing": {"otlpEndpoint": "http://otel-collector.observability:4318", "protocol": "http/protobuf"}},
    "watched namespaces, persistent redis": {
        "operator": {"watchNamespaces": ["models-a", "models-b"]},
        "redis": {"persistence": {"enabled": True, "size": "2Gi"}},
    },
}


def test_lint_strict_passes() -> None:
    result = helm("lint", "--strict", str(CHART))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_object_passes_the_official_schemas(name: str) -> None:
    docs = render(VALUE_SETS[name], crds=True)
    for doc in docs:
        if doc["kind"] == "InferenceDeployment":
            crd_validator().validate(doc)
            parse_spec(doc["spec"])
        elif doc["kind"] == "InferencePool":
            inference_pool_validator().validate(doc)
        elif doc["apiVersion"] == "monitoring.coreos.com/v1":
            monitoring_validator().validate(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            pod = doc["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, doc["metadata"]["name"]
            for container in pod["containers"]:
                assert container["resources"]["requests"], container["name"]
                assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_defaults_install_the_operator_gateway_redis_and_crd() -> None:
    docs = render(crds=True)
    assert kinds(docs) == sorted([
        "ClusterRole", "ClusterRoleBinding", "ConfigMap", "CustomResourceDefinition", "Deployment", "Deployment",
        "Pod", "Secret", "Service", "Service", "ServiceAccount", "StatefulSet",
    ])  # fmt: skip
    gateway = find(docs, "Deployment", "pf-pagefleet-gateway")
    assert gateway["spec"]["replicas"] == 2
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "ghcr.io/pagefleet/gateway:0.1.0" and container["args"] == ["gateway"]
    env = env_of(container)
    assert env["PAGEFLEET_GATEWAY_REDIS_URL"] == "redis://:$(REDIS_PASSWORD)@pf-pagefleet-redis.pagefleet.svc:6379/0"
    assert env["REDIS_PASSWORD"]["secretKeyRef"] == {"name": "pf-pagefleet-redis", "key": "password"}
    assert list(env) == ["REDIS_PASSWORD", "PAGEFLEET_GATEWAY_REDIS_URL"]  # defined before it is referenced
    operator = find(docs, "Deployment", "pf-pagefleet-operator")
    assert operator["spec"]["replicas"] == 1 and operator["spec"]["strategy"]["type"] == "Recreate"
    operator_env = env_of(operator["spec"]["template"]["spec"]["containers"][0])
    # Engines get $(REDIS_PASSWORD) unexpanded and the Secret to fill it from.
    assert operator_env["PAGEFLEET_OPERATOR_ENGINE_REDIS_URL"].startswith("redis://:$$(REDIS_PASSWORD)@")
    assert operator_env["PAGEFLEET_OPERATOR_ENGINE_REDIS_PASSWORD_SECRET"] == "pf-pagefleet-redis/password"
    assert operator_env["PAGEFLEET_OPERATOR_ENGINE_IMAGE"] == "ghcr.io/pagefleet/engine:0.1.0"
    redis = find(docs, "StatefulSet")
    assert redis["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    secret = find(docs, "Secret", "pf-pagefleet-redis")
    assert len(secret["data"]["password"]) > 20
    test_pod = find(docs, "Pod")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert "/v1/models" in test_pod["spec"]["containers"][0]["args"][0]


def test_the_operator_settings_from_the_chart_parse() -> None:
    """The operator's environment, as rendered, is accepted by OperatorSettings."""
    docs = render({"operator": {"watchNamespaces": ["a", "b"], "reconcileIntervalSeconds": 5}})
    env = env_of(find(docs, "Deployment", "pf-pagefleet-operator")["spec"]["template"]["spec"]["containers"][0])
    plain = {k.removeprefix("PAGEFLEET_OPERATOR_").lower(): v for k, v in env.items() if isinstance(v, str)}
    settings = OperatorSettings(**{k: json.loads(v) if k == "namespaces" else v for k, v in plain.items()})
    assert settings.namespaces == ["a", "b"] and settings.reconcile_interval_s == 5.0


def test_the_picker_and_an_inference_pool_per_model() -> None:
    """The pool selects exactly the engine pods the operator makes for the model, on their
    port, and names the picker's Service, whose environment PickerSettings accepts."""
    docs = render({"picker": {"enabled": True}, "models": [FIRST_MODEL, {**FIRST_MODEL, "name": "second"}]})
    pools = {d["metadata"]["name"]: d for d in docs if d["kind"] == "InferencePool"}
    assert sorted(pools) == ["second", "smollm2"]
    pool = pools["smollm2"]
    validator = inference_pool_validator()
    validator.validate(pool)
    owner = Owner(name="smollm2", namespace=NAMESPACE, uid="u-1")
    engine_labels = labels(owner, parse_spec(FIRST_MODEL["spec"]))
    assert pool["spec"]["selector"]["matchLabels"].items() <= engine_labels.items()
    assert pools["second"]["spec"]["selector"]["matchLabels"] != pool["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["targetPorts"] == [{"number": OperatorSettings().engine_port}]
    reference = pool["spec"]["endpointPickerRef"]
    assert reference["failureMode"] == "FailClose" and reference["port"] == {"number": 9002}
    service = find(docs, "Service", reference["name"])
    assert {"name": "grpc-ext-proc", "port": 9002, "targetPort": "grpc", "protocol": "TCP"}.items() <= (
        service["spec"]["ports"][0].items()
    )
    picker = find(docs, "Deployment", "pf-pagefleet-picker")
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    pod = picker["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert find(docs, "ServiceAccount", pod["serviceAccountName"])["automountServiceAccountToken"] is False
    container = pod["containers"][0]
    assert container["args"] == ["picker"] and container["readinessProbe"]["grpc"] == {
        "port": 9002,
        "service": "readiness",
    }
    plain = {k.removeprefix("PAGEFLEET_PICKER_").lower(): v for k, v in env_of(container).items() if isinstance(v, str)}
    settings = PickerSettings(**{k: json.loads(v) if k == "model_policies" else v for k, v in plain.items()})
    assert (settings.host, settings.port, settings.metrics_port, settings.policy) == ("0.0.0.0", 9002, 9090, "affinity")
    # A pool that breaks the published schema is refused by the same check.
    broken = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 8000}, {"number": 8001}]}}
    assert not validator.is_valid(broken)
    assert "InferencePool" not in kinds(render({"models": [FIRST_MODEL]})), "no pools without the picker"


def test_the_chart_crd_is_byte_identical_to_the_repository_crd() -> None:
    chart_crds = sorted(p.name for p in (CHART / "crds").iterdir())
    root_crds = sorted(p.name for p in (ROOT / "crds").iterdir())
    assert chart_crds == root_crds
    for name in root_crds:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), name


def _rules_as_permissions(rules: list[dict[str, Any]]) -> dict[tuple[str, str], frozenset[str]]:
    granted: dict[tuple[str, str], frozenset[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                granted[(group, resource)] = granted.get((group, resource), frozenset()) | set(rule["verbs"])
    return granted


def test_operator_rbac_grants_exactly_the_calls_the_operator_makes() -> None:
    """kube.PERMISSIONS is enforced by the operator's API client and checked against every
    call the operator made in tests/operator; the chart must grant exactly that."""
    cluster_wide = render()
    assert _rules_as_permissions(find(cluster_wide, "ClusterRole")["rules"]) == PERMISSIONS
    binding = find(cluster_wide, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pf-pagefleet-operator", "namespace": NAMESPACE}]
    scoped = render(VALUE_SETS["watched namespaces, persistent redis"])
    roles = [d for d in scoped if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["models-a", "models-b"]
    assert all(_rules_as_permissions(r["rules"]) == PERMISSIONS for r in roles)
    assert not [d for d in scoped if d["kind"].startswith("Cluster")]


def test_external_redis_replaces_the_statefulset_with_a_url_secret() -> None:
    docs = render(VALUE_SETS["external redis"])
    assert "StatefulSet" not in kinds(docs)
    url_secret = find(docs, "Secret", "pf-pagefleet-redis-url")
    assert url_secret["stringData"]["url"] == "rediss://:secret@redis.example:6380/0"
    gateway_env = env_of(find(docs, "Deployment", "pf-pagefleet-gateway")["spec"]["template"]["spec"]["containers"][0])
    assert gateway_env["PAGEFLEET_GATEWAY_REDIS_URL"]["secretKeyRef"] == {
        "name": "pf-pagefleet-redis-url",
        "key": "url",
    }
    docs = render(VALUE_SETS["external redis from a secret"])
    assert "Secret" not in kinds(docs)
    operator_env = env_of(
        find(docs, "Deployment", "pf-pagefleet-operator")["spec"]["template"]["spec"]["containers"][0]
    )
    assert operator_env["PAGEFLEET_OPERATOR_ENGINE_REDIS_SECRET"] == "my-redis/url"


def test_gateway_autoscaling_drops_fixed_replicas_and_adds_an_hpa() -> None:
    docs = render(VALUE_SETS["gateway autoscaling and ingress"])
    assert "replicas" not in find(docs, "Deployment", "pf-pagefleet-gateway")["spec"]
    hpa = find(docs, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pf-pagefleet-gateway"
    ingress = find(docs, "Ingress")
    assert ingress["spec"]["ingressClassName"] == "nginx" and ingress["spec"]["tls"][0]["secretName"] == "tls"


def test_first_models_are_rendered_as_inference_deployments() -> None:
    model = find(render(VALUE_SETS["a first model"]), "InferenceDeployment")
    assert model["metadata"] == {
        "name": "smollm2", "namespace": NAMESPACE, "labels": model["metadata"]["labels"],
    }  # fmt: skip
    assert model["spec"] == FIRST_MODEL["spec"]


def test_api_keys_from_an_existing_or_a_created_secret() -> None:
    docs = render(VALUE_SETS["api keys from an existing secret"])
    assert "Secret" not in [d["kind"] for d in docs if d["metadata"]["name"].endswith("api-keys")]
    pod = find(docs, "Deployment", "pf-pagefleet-gateway")["spec"]["template"]["spec"]
    assert {"name": "api-keys", "secret": {"secretName": "keys"}} in pod["volumes"]
    config = find(docs, "ConfigMap")["data"]
    assert config["PAGEFLEET_GATEWAY_API_KEYS_FILE"] == "/etc/pagefleet/api-keys/api-keys"
    docs = render(VALUE_SETS["api keys created by the chart"])
    created = find(docs, "Secret", "pf-pagefleet-api-keys")
    assert created["stringData"]["api-keys"].split() == ["sk-first-key", "sk-second-key"]
    assert find(docs, "ConfigMap")["data"]["PAGEFLEET_GATEWAY_REQUESTS_PER_MINUTE"] == "60"


def test_gateway_pods_roll_when_their_configuration_changes() -> None:
    def checksums(values: dict[str, Any]) -> dict[str, str]:
        pod = find(render(values), "Deployment", "pf-pagefleet-gateway")["spec"]["template"]["metadata"]
        return {k: v for k, v in pod["annotations"].items() if k.startswith("checksum/")}

    base = checksums({})
    assert base == checksums({})  # stable
    assert checksums({"gateway": {"policy": "prefix"}})["checksum/config"] != base["checksum/config"]
    keys = {"gateway": {"apiKeys": {"enabled": True, "keys": ["sk-first-key"]}}}
    other = {"gateway": {"apiKeys": {"enabled": True, "keys": ["sk-other-key"]}}}
    assert checksums(keys)["checksum/api-keys"] != checksums(other)["checksum/api-keys"]


def test_names_stay_within_63_characters() -> None:
    docs = render(release="a-release-name-at-the-longest-that-helm-allows-53-chr")  # 53 characters
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"]
    assert len(set(names)) == 2 and all(n.endswith(("-gateway", "-operator")) for n in names)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gateway": {"replicas": "two"}}, "/gateway/replicas"),
        ({"gateway": {"policy": "random"}}, "/gateway/policy"),
        ({"gatway": {}}, "gatway"),
        ({"redis": {"persistence": {"sizee": "1Gi"}}}, "sizee"),
        ({"operator": {"resources": {"requests": None}}}, "requests"),  # null deletes a default
        ({"models": [{"name": "x"}]}, "spec"),
        ({"gateway": {"apiKeys": {"enabled": True}}}, "gateway.apiKeys.keys"),
        ({"redis": {"enabled": False}}, "redis.external.url"),
        ({"picker": {"failureMode": "Open"}}, "/picker/failureMode"),
    ],
)
def test_bad_values_are_refused(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)


def test_install_notes_say_how_to_reach_the_gateway_and_apply_a_first_model() -> None:
    result = helm("install", "pagefleet", str(CHART), "--namespace", NAMESPACE, "--dry-run=client")
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} port-forward svc/pagefleet-gateway 8000:80" in notes
    assert f"kubectl -n {NAMESPACE} apply -f" in notes and "examples/smollm2-cpu.yaml" in notes
    assert "/v1/chat/completions" in notes and f"helm test pagefleet -n {NAMESPACE}" in notes


def test_examples_take_their_namespace_from_kubectl() -> None:
    """`kubectl -n NS apply -f examples/...` (as NOTES.txt and docs/install.md say) needs
    examples without a namespace of their own."""
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        assert "namespace" not in yaml.safe_load(path.read_text())["metadata"], path.name


def test_monitors_scrape_the_gateway_picker_operator_and_every_engine_pod() -> None:
    docs = render({**VALUE_SETS["metrics: monitors and dashboards"], "operator": {"watchNamespaces": ["models"]}})
    monitors = {d["metadata"]["name"]: d for d in docs if d["apiVersion"] == "monitoring.coreos.com/v1"}
    assert {name: d["kind"] for name, d in monitors.items()} == {
        "pf-pagefleet-gateway": "ServiceMonitor",
        "pf-pagefleet-picker": "ServiceMonitor",
        "pf-pagefleet-operator": "PodMonitor",
        "pf-pagefleet-engines": "PodMonitor",
    }
    for monitor in monitors.values():
        monitoring_validator().validate(monitor)
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"  # what Prometheus selects
    # Each ServiceMonitor selects its Service and names one of its ports.
    for component in ("gateway", "picker"):
        service = find(docs, "Service", f"pf-pagefleet-{component}")
        spec = monitors[f"pf-pagefleet-{component}"]["spec"]
        assert spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
        assert {e["port"] for e in spec["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    # The operator's PodMonitor selects its pod and names the port its metrics are served on.
    operator = find(docs, "Deployment", "pf-pagefleet-operator")["spec"]["template"]
    spec = monitors["pf-pagefleet-operator"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= operator["metadata"]["labels"].items()
    container = operator["spec"]["containers"][0]
    assert spec["podMetricsEndpoints"][0]["port"] in {p["name"] for p in container["ports"]}
    assert env_of(container)["PAGEFLEET_OPERATOR_METRICS_PORT"] == str(
        next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    )
    # The engines' PodMonitor selects the pods the operator makes, in the namespaces it watches.
    spec = monitors["pf-pagefleet-engines"]["spec"]
    engine = labels(Owner("smollm2", "models", "uid"), parse_spec(FIRST_MODEL["spec"]))
    assert spec["selector"]["matchLabels"].items() <= engine.items()
    assert spec["namespaceSelector"] == {"matchNames": ["models"]}
    assert spec["podMetricsEndpoints"][0]["port"] == "http"  # the engine container's port name
    # Off by default: a cluster without the Prometheus Operator's CRDs installs the chart.
    assert not [d for d in render() if d["apiVersion"] == "monitoring.coreos.com/v1"]


def test_grafana_dashboards_are_configmaps_for_the_sidecar_holding_the_generated_dashboard() -> None:
    import runpy

    generator = runpy.run_path(str(ROOT / "scripts" / "grafana_dashboard.py"))
    assert (CHART / "dashboards" / "pagefleet-fleet.json").read_text() == generator["render"](), (
        "the dashboard JSON is stale: run python scripts/grafana_dashboard.py"
    )
    docs = render(VALUE_SETS["metrics: monitors and dashboards"])
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "pagefleet"}
    dashboard = json.loads(config_map["data"]["pagefleet-fleet.json"])
    assert dashboard["uid"] == "pagefleet-fleet"
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {
        "KV cache usage",
        "Output tokens/s",
        "Time to first token",
        "Inter-token latency",
        "Errors/s by status",
    } <= titles
    assert all(target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", []))
    elsewhere = render({"metrics": {"grafanaDashboards": {"enabled": True, "namespace": "monitoring"}}})
    assert find(elsewhere, "ConfigMap", "pf-pagefleet-dashboard-fleet")["metadata"]["namespace"] == "monitoring"


def test_tracing_reaches_the_gateway_and_through_the_operator_every_engine() -> None:
    from pagefleet.engine.server.settings import ServerSettings
    from pagefleet.gateway.settings import GatewaySettings

    docs = render(VALUE_SETS["tracing"])
    gateway = env_of(find(docs, "Deployment", "pf-pagefleet-gateway")["spec"]["template"]["spec"]["containers"][0])
    endpoint = "http://otel-collector.observability:4318"
    assert gateway["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert GatewaySettings(otlp_traces_endpoint=gateway["PAGEFLEET_GATEWAY_OTLP_TRACES_ENDPOINT"]).otlp_traces_endpoint
    operator = env_of(find(docs, "Deployment", "pf-pagefleet-operator")["spec"]["template"]["spec"]["containers"][0])
    plain = {k.removeprefix("PAGEFLEET_OPERATOR_").lower(): v for k, v in operator.items() if isinstance(v, str)}
    settings = OperatorSettings(**{k: json.loads(v) if k == "namespaces" else v for k, v in plain.items()})
    pod = find_engine_pod(settings)
    engine = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert engine["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    variables = {
        k.removeprefix("PAGEFLEET_ENGINE_").lower(): v for k, v in engine.items() if k.startswith("PAGEFLEET_ENGINE_")
    }
    assert ServerSettings.model_validate(variables).otlp_traces_endpoint == endpoint
    assert "PAGEFLEET_GATEWAY_OTLP_TRACES_ENDPOINT" not in env_of(
        find(render(), "Deployment", "pf-pagefleet-gateway")["spec"]["template"]["spec"]["containers"][0]
    )  # off by default


def find_engine_pod(settings: OperatorSettings) -> dict[str, Any]:
    from pagefleet.operator import manifests

    objects = manifests.desired_objects(Owner("smollm2", NAMESPACE, "uid"), parse_spec(FIRST_MODEL["spec"]), settings)
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return deployment["spec"]["template"]["spec"]
