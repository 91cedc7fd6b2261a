"""Settings of `pagefleet gateway`: flags and `PAGEFLEET_GATEWAY_*` variables."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagefleet.protocol.replica import RECORD_TTL_S

Policy = Literal["kv", "round_robin", "least_requests", "prefix"]


def seconds(default: float, description: str, old_name: str) -> Any:
    """A duration in seconds, named `..._s`; the flag's old name (no unit) still works."""
    names = AliasChoices(old_name + "_s", old_name)
    return Field(default, description=f"seconds {description}", validation_alias=names)


class GatewaySettings(BaseSettings):
    """`pagefleet gateway ...`; every flag also reads from the environment as
    PAGEFLEET_GATEWAY_<NAME> (e.g. PAGEFLEET_GATEWAY_REFRESH_INTERVAL_S)."""

    model_config = SettingsConfigDict(
        env_prefix="PAGEFLEET_GATEWAY_", cli_kebab_case=True, cli_prog_name="pagefleet gateway", populate_by_name=True
    )

    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    policy: Policy = Field("kv", description="kv, round_robin, least_requests or prefix")
    model_policies: dict[str, Policy] = Field(default_factory=dict, description='per model, e.g. {"m": "prefix"}')
    api_keys: list[str] = Field(default_factory=list, description="accepted Bearer keys; none: no auth")
    api_keys_file: Path | None = Field(None, description="one key per line (a mounted Secret)")
    requests_per_minute: int = Field(0, description="per key; 0: unlimited")
    tokens_per_minute: int = Field(0, description="per key, prompt + max_tokens estimated; 0: unlimited")
    max_request_bytes: int = 1 << 20
    refresh_interval_s: float = seconds(0.2, "between registry refreshes from Redis", "refresh_interval")
    record_ttl_s: float = seconds(RECORD_TTL_S, "a replica's record lives unless refreshed", "record_ttl")
    redis_grace_s: float = seconds(30.0, "to keep routing on the last registry without Redis", "redis_grace")
    forget_model_after_s: float = Field(
        600.0, description="seconds a model with no live replica stays known (503 retry, not 404)"
    )
    failover_attempts: int = 3
    eject_after_failures: int = Field(
        3, ge=1, description="consecutive failures (connection errors, timeouts, 503) before a replica is skipped"
    )
    exclude_failed_for_s: float = seconds(10.0, "a replica is skipped after those failures", "exclude_failed_for")
    connect_timeout_s: float = seconds(2.0, "to connect to a replica", "connect_timeout")
    read_timeout_s: float = seconds(600.0, "to wait for a replica's next bytes", "read_timeout")
    log_level: str = "INFO"

    def keys(self) -> set[str]:
        keys = set(self.api_keys)
        if self.api_keys_file is not None:
            keys |= {line.strip() for line in self.api_keys_file.read_text().splitlines() if line.strip()}
        return keys
