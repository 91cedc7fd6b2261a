"""The operator's Prometheus metrics (`pagefleet_operator:*`), served on their own port for
a ServiceMonitor: how reconciles go, and what the autoscaler sees and decides, per resource
and pool (`pool` is "" for a model with one pool, else "prefill" or "decode")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagefleet.runtime.metrics_http import MetricsServer, serve_metrics


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "pagefleet_operator:reconciles", "Reconciles of InferenceDeployments, by result (ok, error).",
            ["namespace", "name", "result"], registry=self.registry,
        )  # fmt: skip
        pool = ["namespace", "name", "pool"]
        self.replicas = Gauge(
            "pagefleet_operator:desired_replicas", "Engine replicas the resource asks for.", pool,
            registry=self.registry,
        )  # fmt: skip
        self.kv_utilization = Gauge(
            "pagefleet_operator:kv_utilization", "Mean KV-cache utilization of the live replicas, as the "
            "autoscaler sees it (0-1).", pool, registry=self.registry,
        )  # fmt: skip
        self.scaling_events = Counter(
            "pagefleet_operator:scaling_events", "Autoscaler decisions that changed the replica count, by reason.",
            [*pool, "reason"], registry=self.registry,
        )  # fmt: skip
        self._server: MetricsServer | None = None

    def serve(self, port: int) -> None:
        self._server = serve_metrics(self.registry, port)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def forget(self, namespace: str, name: str) -> None:
        """Drop a deleted resource's series, so its last figures do not linger."""
        for metric in (self.reconciles, self.replicas, self.kv_utilization, self.scaling_events):
            for labels in list(metric._metrics):  # noqa: SLF001 - prometheus_client has no public listing
                if labels[:2] == (namespace, name):
                    metric.remove(*labels)
