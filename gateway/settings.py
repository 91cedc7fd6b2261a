"""Settings of `pagefleet gateway` (flags and `PAGEFLEET_GATEWAY_*` variables) and of
`pagefleet picker` (`PAGEFLEET_PICKER_*`): what both routers share, then each one's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagefleet.protocol.replica import RECORD_TTL_S

Policy = Literal["affinity", "kv", "round_robin", "least_requests", "prefix"]


def seconds(default: float, description: str) -> Any:
    """A duration in seconds (its name ends in `_s`)."""
    return Field(default, description=f"seconds {description}")


class RoutingSettings(BaseSettings):
    """Where the replicas are, how one is picked, and who may ask."""

    # Old names (before durations said their unit) still read, as flags and variables.
    renamed: ClassVar[dict[str, str]] = {
        name: name + "_s" for name in ("refresh_interval", "record_ttl", "redis_grace")
    }

    redis_url: str = "redis://127.0.0.1:6379/0"
    policy: Policy = Field(
        "affinity", description="affinity (docs/routing.md), kv, round_robin, least_requests or prefix"
    )
    model_policies: dict[str, Policy] = Field(default_factory=dict, description='per model, e.g. {"m": "prefix"}')
    api_keys: list[str] = Field(default_factory=list, description="accepted Bearer keys; none: no auth")
    api_keys_file: Path | None = Field(None, description="one key per line (a mounted Secret)")
    requests_per_minute: int = Field(0, description="per key; 0: unlimited")
    tokens_per_minute: int = Field(0, description="per key, prompt + max_tokens estimated; 0: unlimited")
    refresh_interval_s: float = seconds(0.2, "between registry refreshes from Redis")
    record_ttl_s: float = seconds(RECORD_TTL_S, "a replica's record lives unless refreshed")
    redis_grace_s: float = seconds(30.0, "to keep routing on the last registry without Redis")
    forget_model_after_s: float = seconds(600.0, "a model with no live replica stays known (503 retry, not 404)")
    hold_timeout_s: float = seconds(
        300.0, "a request for a model scaled to zero is held while a replica starts (then 503 with Retry-After)"
    )
    hold_max_requests: int = Field(
        256, ge=0, description="requests held at most per model scaled to zero; more get 503 at once"
    )
    saturation_s: float = Field(
        1.0,
        gt=0,
        description="seconds of queued prompt prefill beyond which `affinity` stops sending a prefix to the "
        "replica that caches it and picks the best by load",
    )
    log_level: str = "INFO"

    def keys(self) -> set[str]:
        keys = set(self.api_keys)
        if self.api_keys_file is not None:
            keys |= {line.strip() for line in self.api_keys_file.read_text().splitlines() if line.strip()}
        return keys


class GatewaySettings(RoutingSettings):
    """`pagefleet gateway ...`; every flag also reads from the environment as
    PAGEFLEET_GATEWAY_<NAME> (e.g. PAGEFLEET_GATEWAY_REFRESH_INTERVAL_S)."""

    model_config = SettingsConfigDict(
        env_prefix="PAGEFLEET_GATEWAY_", cli_kebab_case=True, cli_prog_name="pagefleet gateway", populate_by_name=True
    )
    renamed: ClassVar[dict[str, str]] = RoutingSettings.renamed | {
        name: name + "_s" for name in ("exclude_failed_for", "connect_timeout", "read_timeout")
    }

    host: str = "127.0.0.1"
    port: int = 8000
    max_request_bytes: int = 1 << 20
    failover_attempts: int = 3
    eject_after_failures: int = Field(
        3, ge=1, description="consecutive failures (connection errors, timeouts, 503) before a replica is skipped"
    )
    exclude_failed_for_s: float = seconds(10.0, "a replica is skipped after those failures")
    connect_timeout_s: float = seconds(2.0, "to connect to a replica")
    read_timeout_s: float = seconds(600.0, "to wait for a replica's next bytes")
    otlp_traces_endpoint: str | None = Field(
        None, description="send OpenTelemetry traces here over OTLP (gRPC, or HTTP with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), e.g. http://localhost:4317; none: no tracing",
    )  # fmt: skip
    dashboard_interval_s: float = Field(2.0, gt=0, description="seconds between the dashboard's samples")
    dashboard_span_s: float = Field(300.0, gt=0, description="seconds of history the dashboard charts")
    dashboard_window_s: float = Field(10.0, gt=0, description="seconds the dashboard's rates and percentiles cover")


class PickerSettings(RoutingSettings):
    """`pagefleet picker ...`: an Endpoint Picker for Envoy's ext_proc; every flag also reads
    from the environment as PAGEFLEET_PICKER_<NAME>."""

    model_config = SettingsConfigDict(
        env_prefix="PAGEFLEET_PICKER_", cli_kebab_case=True, cli_prog_name="pagefleet picker", populate_by_name=True
    )

    host: str = Field("127.0.0.1", description="the gRPC address (0.0.0.0 in a pod)")
    port: int = Field(9002, description="ext_proc and gRPC health (the Gateway API Inference Extension's port)")
    metrics_port: int = Field(9090, description="Prometheus /metrics over HTTP; 0: none")
    fallbacks: int = Field(
        0,
        ge=0,
        description="other replicas listed after the chosen one, for a proxy that retries down the list "
        "(Envoy's override_host policy); keep 0 for an ORIGINAL_DST cluster, which takes one address",
    )
    prefill_attempts: int = Field(
        3, ge=1, description="prefill replicas a disaggregated model's prompt may try before one replica runs it all"
    )
    prefill_timeout_s: float = seconds(300.0, "a prompt may take on its prefill replica")
