"""Settings of `pagefleet serve`: command-line flags and `PAGEFLEET_ENGINE_*` variables."""

from __future__ import annotations

import os
import socket
from typing import Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pagefleet.engine.config import EngineConfig, simulated_defaults
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.server.lora import parse_lora_modules
from pagefleet.protocol.replica import PUBLISH_INTERVAL_S, RECORD_TTL_S
from pagefleet.runtime.response_store import DEFAULT_TTL_S as DEFAULT_RESPONSE_TTL_S


def _default(name: str) -> Any:
    return EngineConfig.__dataclass_fields__[name].default


# Fields of EngineConfig that `serve` exposes under the same names.
ENGINE_FIELDS = (
    "dtype",
    "block_size",
    "kv_cache_memory",
    "num_kv_blocks",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "disable_hybrid_kv_cache_manager",
    "preemption_mode",
    "swap_space",
    "seed",
    "device",
    "attention_backend",
    "mla_prefill",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "tensor_parallel_size",
    "max_logprobs",
    "skip_tokenizer_init",
    "kv_cache_dir",
    "kv_cache_dir_size_gib",
    "speculative_config",
    "quantization",
    "simulate",
    "time_scale",
)


class ServerSettings(BaseSettings):
    """`pagefleet serve --model ... --port ...`; every flag also reads from the environment
    as PAGEFLEET_ENGINE_<NAME> (e.g. PAGEFLEET_ENGINE_REDIS_URL)."""

    model_config = SettingsConfigDict(
        env_prefix="PAGEFLEET_ENGINE_",
        cli_kebab_case=True,
        cli_prog_name="pagefleet serve",
        cli_implicit_flags=True,  # vLLM's --enable-lora, --no-enable-prefix-caching
    )
    # vLLM's --lora-modules a=/x b=/y and --api-key k1 k2
    multi_value_flags: ClassVar[tuple[str, ...]] = ("lora_modules", "api_key")

    model: str = Field(_default("model"), description="built-in name, HF directory or .gguf file")
    served_model_name: str | None = Field(None, description="the name clients send as `model` (default: --model)")
    host: str = "127.0.0.1"
    port: int = 8001
    advertise_url: str | None = Field(
        None, description="URL the fleet reaches this replica at (default http://host:port)"
    )
    api_key: list[str] = Field(
        default_factory=lambda: [key for key in [os.environ.get("VLLM_API_KEY", "")] if key],
        description="keys the /v1 routes require as `Authorization: Bearer` (default: $VLLM_API_KEY; none: open)",
    )
    root_path: str = Field("", description="the path prefix a proxy serves this server under (vLLM's flag)")
    replica_id: str | None = Field(None, description="this replica's id in Redis (default hostname-port)")
    redis_url: str | None = Field(None, description="publish KV capacity here, e.g. redis://localhost:6379/0")
    publish_interval: float = PUBLISH_INTERVAL_S
    record_ttl: float = RECORD_TTL_S
    response_store_ttl: float = Field(
        DEFAULT_RESPONSE_TTL_S, gt=0, description="seconds a stored response (Responses API) is kept"
    )
    max_waiting_requests: int = Field(256, description="queued requests beyond which new ones get 503")
    max_request_bytes: int = Field(1 << 20, description="larger request bodies get 413")
    enable_force_include_usage: bool = Field(
        False, description="streams end with a usage chunk even when the request did not ask (vLLM's flag)"
    )
    enable_prompt_tokens_details: bool = Field(
        False, description="usage carries prompt_tokens_details (cached tokens), as vLLM's flag"
    )
    return_tokens_as_token_ids: bool = Field(
        False, description='logprobs name every token "token_id:<id>", whatever the request says (vLLM\'s flag)'
    )
    enable_server_load_tracking: bool = Field(
        False, description="GET /load counts the generation requests in flight (vLLM's flag; else 0)"
    )
    exit_grace: float = Field(1.0, description="seconds in-flight requests get to be answered after the engine dies")
    shutdown_timeout: float = Field(
        30.0,
        ge=0,
        description="after SIGTERM, seconds in-flight requests get to finish before they end with an error "
        "(vLLM's flag); new requests get 503 meanwhile",
    )
    restarts: int = Field(0, ge=0, description="times a supervisor restarted this replica (shown on the dashboard)")
    log_level: str = "INFO"
    otlp_traces_endpoint: str | None = Field(
        None, description="send OpenTelemetry traces here over OTLP (gRPC, or HTTP with "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf), e.g. http://localhost:4317; none: no tracing",
    )  # fmt: skip
    role: Literal["prefill", "decode", "both"] = Field(
        "both",
        description="prefill/decode disaggregation: prefill (prompts whose KV decode replicas pull), "
        "decode (requests whose prompt KV is pulled from a prefill replica) or both",
    )
    kv_pin_timeout: float = Field(
        _default("kv_pin_timeout"), gt=0, description="seconds a prefilled prompt's blocks wait to be pulled"
    )
    kv_transfer_timeout: float = Field(30.0, gt=0, description="seconds a KV pull may take")
    enable_lora: bool = Field(False, description="serve LoRA adapters over the base model (multi-LoRA)")
    lora_modules: list[str | dict[str, Any]] = Field(
        default_factory=list,
        description='adapters to serve from the start: name=path or {"name": ..., "path": ...}, one or more',
    )
    max_loras: int = Field(_default("max_loras"), description="adapters in device slots at once")
    max_lora_rank: int = Field(_default("max_lora_rank"), description="the largest adapter rank served")

    dtype: str = _default("dtype")
    quantization: str | None = Field(
        None,
        description="a quantized model's weights: gguf (a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K "
        "served as stored), "
        "compressed-tensors (an int8 W8A8 checkpoint run as int8 GEMMs); each the default for its models "
        "on a CPU; or none (dequantized to --dtype)",
    )
    block_size: int = _default("block_size")
    kv_cache_memory: float | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = _default("max_num_seqs")
    max_num_batched_tokens: int = _default("max_num_batched_tokens")
    enable_prefix_caching: bool = _default("enable_prefix_caching")
    disable_hybrid_kv_cache_manager: bool = Field(
        _default("disable_hybrid_kv_cache_manager"),
        description="keep every block of sliding-window layers (one KV cache group), as vLLM's flag",
    )
    preemption_mode: str = _default("preemption_mode")
    swap_space: int = _default("swap_space")
    seed: int = _default("seed")
    device: str = _default("device")
    attention_backend: str = _default("attention_backend")
    mla_prefill: Literal["absorbed", "expanded"] = Field(
        _default("mla_prefill"),
        description="latent attention's prompt rows: over keys and values expanded per head (about 2x the"
        " prompt throughput) or in the latent space as decodes, every block prefix-cached (docs/engine.md)",
    )
    max_logprobs: int = Field(_default("max_logprobs"), description="the most logprobs a request may ask for; -1: all")
    kv_cache_dir: str | None = Field(
        None, description="the KV file tier's directory, shared by a model's replicas (docs/kv-tiers.md)"
    )
    kv_cache_dir_size_gib: float = Field(_default("kv_cache_dir_size_gib"), description="the file tier's size limit")
    kv_peer_pulls: Literal["auto", "always", "off"] = Field(
        "auto",
        description="pull a prompt's prefix from the replica the gateway names as its holder: when the cost "
        "model says it beats computing it (auto), whenever the peer may have more (always), never (docs/kv-tiers.md)",
    )
    speculative_config: dict[str, Any] | None = Field(
        None,
        description='speculative decoding without a draft model, vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\' (docs/engine.md)',
    )
    skip_tokenizer_init: bool = Field(
        _default("skip_tokenizer_init"), description="load no tokenizer: token ids in, token ids out (vLLM's)"
    )
    enable_tokenizer_info_endpoint: bool = Field(
        True, description="serve GET /tokenizer_info (vLLM's flag; on here: the gateway routes on it)"
    )
    tensor_parallel_size: int = Field(
        _default("tensor_parallel_size"), description="devices (on a CPU: processes) the model is split across"
    )
    simulate: str | None = Field(
        None,
        description="run a cost model of PROFILE (gpu-8b, gpu-70b-tp4, cpu-smollm2) instead of a model: the "
        "scheduler, KV cache, prefix cache, events and metrics run for real; --model gives the tokenizer",
    )
    time_scale: float = Field(
        _default("time_scale"), gt=0, description="with --simulate: stretch every modelled duration this many times"
    )

    _engine_config: EngineConfig | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_engine_config(self) -> ServerSettings:
        """Build the engine's config now, so a bad engine flag is refused when the settings
        are parsed (naming the flag), not when the model loads."""
        if self.simulate is not None:
            self._take_profile_defaults()
        try:
            self._engine_config = EngineConfig(
                model=self.model,
                kv_role=self.role,
                kv_pin_timeout=self.kv_pin_timeout,
                **{name: getattr(self, name) for name in ENGINE_FIELDS},
            )
        except InvalidParameterError as error:
            flag = "--" + error.param.replace("_", "-")
            raise ValueError(f"{flag}: {str(error).removeprefix(error.param + ': ')}") from error
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules: needs --enable-lora")
        parse_lora_modules(self.lora_modules)
        return self

    def _take_profile_defaults(self) -> None:
        """A simulated replica's batch limits are its profile's unless given; it pulls no
        KV from peers (it holds none)."""
        for name, value in simulated_defaults(self.simulate or "").items():
            if name not in self.model_fields_set:
                setattr(self, name, value)
        self.kv_peer_pulls = "off"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"

    @property
    def replica(self) -> str:
        return self.replica_id or f"{socket.gethostname()}-{self.port}"

    def engine_config(self) -> EngineConfig:
        assert self._engine_config is not None, "built when the settings were validated"
        return self._engine_config
