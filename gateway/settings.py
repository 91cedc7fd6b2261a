"""Settings of `pagefleet gateway`: flags and `PAGEFLEET_GATEWAY_*` variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagefleet.protocol.replica import RECORD_TTL_S


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="PAGEFLEET_GATEWAY_", cli_kebab_case=True, cli_prog_name="pagefleet gateway"
    )

    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    policy: str = Field("kv", description="kv, round_robin, least_requests or prefix")
    model_policies: dict[str, str] = Field(default_factory=dict, description='per model, e.g. {"m": "prefix"}')
    api_keys: list[str] = Field(default_factory=list, description="accepted Bearer keys; none: no auth")
    api_keys_file: Path | None = Field(None, description="one key per line (a mounted Secret)")
    requests_per_minute: int = Field(0, description="per key; 0: unlimited")
    tokens_per_minute: int = Field(0, description="per key, prompt + max_tokens estimated; 0: unlimited")
    max_request_bytes: int = 1 << 20
    refresh_interval: float = Field(0.2, description="seconds between registry refreshes from Redis")
    record_ttl: float = RECORD_TTL_S
    redis_grace: float = Field(30.0, description="seconds to keep routing on the last registry without Redis")
    failover_attempts: int = 3
    eject_after_failures: int = Field(
        3, ge=1, description="consecutive failures (connection errors, timeouts, 503) before a replica is skipped"
    )
    exclude_failed_for: float = Field(10.0, description="seconds a replica is skipped after those failures")
    connect_timeout: float = 2.0
    read_timeout: float = 600.0
    log_level: str = "INFO"

    def keys(self) -> set[str]:
        keys = set(self.api_keys)
        if self.api_keys_file is not None:
            keys |= {line.strip() for line in self.api_keys_file.read_text().splitlines() if line.strip()}
        return keys
