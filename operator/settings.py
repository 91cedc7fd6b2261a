"""Settings of `pagefleet operator`: flags and `PAGEFLEET_OPERATOR_*` variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class OperatorSettings(BaseSettings):
    """`pagefleet operator --namespaces ...`; each flag also reads PAGEFLEET_OPERATOR_<NAME>."""

    model_config = SettingsConfigDict(
        env_prefix="PAGEFLEET_OPERATOR_", cli_kebab_case=True, cli_prog_name="pagefleet operator"
    )

    namespaces: list[str] = Field([], description="namespaces to watch (default: the whole cluster)")
    redis_url: str = Field("redis://localhost:6379/0", description="where the replicas publish their KV capacity")
    engine_redis_url: str | None = Field(None, description="the Redis URL the engine pods get (default --redis-url)")
    engine_redis_secret: str | None = Field(
        None, description="take the engines' Redis URL from this Secret instead, as name/key"
    )
    engine_redis_password_secret: str | None = Field(
        None,
        description="give the engines REDIS_PASSWORD from this Secret (name/key), for $(REDIS_PASSWORD) in the URL",
    )
    engine_otlp_traces_endpoint: str | None = Field(
        None, description="the engines send OpenTelemetry traces here (their --otlp-traces-endpoint); none: off"
    )
    engine_otlp_traces_protocol: Literal["grpc", "http/protobuf"] = Field(
        "grpc", description="OTLP over gRPC or HTTP, for that endpoint (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)"
    )
    engine_image: str = Field("ghcr.io/pagefleet/engine:0.1.0", description="engine image when a spec names none")
    engine_port: int = 8000
    reconcile_interval_s: float = Field(10.0, gt=0, description="the periodic reconcile: status and autoscaling")
    health_port: int | None = Field(8080, description="serve /healthz here for the liveness probe (none: off)")
    metrics_port: int | None = Field(9090, description="serve Prometheus /metrics here (none: off)")
    liveness_probe: bool = True
    log_level: str = "INFO"
