"""The InferenceDeployment spec as a pydantic model: the CRD's schema in Python.

The API server checks the CRD's schema and CEL rules when a resource is written; the
operator checks again here (a resource written before a CRD upgrade, or to a server that
skips CEL, must still fail cleanly), and the tests hold the two to the same intent. Field
names are the CRD's camelCase ones; defaults are the CRD's defaults.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic.alias_generators import to_camel

BUILTIN_MODELS = ("smollm2-135m-instruct",)
MODELS_MOUNT = "/models"
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_QUANTITY_TEXT = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY_SCALE = {None: 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class ModelVolume(_Spec):
    claim_name: str = Field(min_length=1)
    sub_path: str | None = None


class ModelSource(_Spec):
    builtin: Literal["smollm2-135m-instruct"] | None = None
    path: str | None = Field(None, min_length=1)
    gguf: str | None = Field(None, pattern=r"\.gguf$")
    volume: ModelVolume | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if sum(value is not None for value in (self.builtin, self.path, self.gguf)) != 1:
            raise ValueError("set exactly one of model.builtin, model.path and model.gguf")
        if self.volume is not None and self.builtin is not None:
            raise ValueError("model.volume holds model.path or model.gguf, not a built-in model")
        return self

    @property
    def engine_argument(self) -> str:
        """What `pagefleet serve --model` gets inside the container."""
        if self.builtin is not None:
            return self.builtin
        location = self.path or self.gguf or ""
        return f"{MODELS_MOUNT}/{location.lstrip('/')}" if self.volume is not None else location


class ModelCache(_Spec):
    claim_name: str | None = Field(None, min_length=1)
    host_path: str | None = Field(None, pattern=r"^/")

    @model_validator(mode="after")
    def _one_place(self) -> ModelCache:
        if (self.claim_name is None) == (self.host_path is None):
            raise ValueError("set exactly one of modelCache.claimName and modelCache.hostPath")
        return self


Quantity = int | Annotated[str, StringConstraints(pattern=_QUANTITY_TEXT)]
"""A Kubernetes quantity: 500m, 2, 4Gi."""


class KVCacheTier(_Spec):
    """The KV file tier (docs/kv-tiers.md): where a model's replicas share full KV blocks,
    and how much it may hold. `claimName` (ReadWriteMany) shares it across nodes, `hostPath`
    among the pods of a node; with neither, each pod has its own emptyDir (a restarted
    container still finds its blocks)."""

    size: Annotated[str, StringConstraints(pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")] = "10Gi"
    claim_name: str | None = Field(None, min_length=1)
    host_path: str | None = Field(None, pattern=r"^/")

    @model_validator(mode="after")
    def _one_place(self) -> KVCacheTier:
        if self.claim_name is not None and self.host_path is not None:
            raise ValueError("set at most one of kvCache.claimName and kvCache.hostPath")
        return self

    @property
    def size_gib(self) -> float:
        match = _QUANTITY.match(self.size)
        assert match is not None, "the field's pattern admits only quantities"
        return float(match.group(1)) * _QUANTITY_SCALE[match.group(2)] / 2**30


class Resources(_Spec):
    cpu: Quantity | None = None
    memory: Quantity | None = None
    cpu_limit: Quantity | None = None
    memory_limit: Quantity | None = None
    gpus: int = Field(0, ge=0, le=16)


class EngineSettings(_Spec):
    block_size: Literal[8, 16, 32] = 16
    kv_cache_memory: str | None = Field(
        None, pattern=r"^([0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?|0?\.[0-9]+|1(\.0+)?)$"
    )
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int = Field(64, ge=1, le=4096)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "gguf", "compressed-tensors", "none"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    max_loras: int = Field(4, ge=1, le=256)
    max_lora_rank: Literal[8, 16, 32, 64, 128, 256] = 16
    extra_args: list[str] = []

    @property
    def kv_cache_bytes_or_fraction(self) -> float | None:
        """`--kv-cache-memory`: a fraction of free memory (at most 1) or a byte count."""
        text = self.kv_cache_memory
        if text is None:
            return None
        if text.startswith(".") or text.startswith("0.") or re.fullmatch(r"1(\.0+)?", text):
            return float(text)
        match = _QUANTITY.match(text)
        assert match is not None, "the field's pattern admits only quantities and fractions"
        return float(match.group(1)) * _QUANTITY_SCALE[match.group(2)]


class Autoscaling(_Spec):
    enabled: bool = False
    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(4, ge=1, le=1000)
    target_kv_utilization: float = Field(0.7, gt=0, le=1, alias="targetKVUtilization")
    scale_up_stabilization_window_seconds: int = Field(0, ge=0, le=3600)
    scale_down_stabilization_window_seconds: int = Field(300, ge=0, le=3600)
    # A prefill pool scales on this instead: queued prompt tokens per replica it aims at.
    target_waiting_prompt_tokens: int = Field(4096, ge=1, le=10_000_000)
    # With minReplicas 0: no request for this long stops every replica (protocol/demand.py).
    idle_seconds: int = Field(300, ge=1, le=86400)

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError("autoscaling.minReplicas must not exceed autoscaling.maxReplicas")
        return self


class Rollout(_Spec):
    max_surge: int = Field(1, ge=0, le=100)
    max_unavailable: int = Field(0, ge=0, le=100)
    drain_seconds: int = Field(30, ge=0, le=3600)

    @model_validator(mode="after")
    def _moves(self) -> Rollout:
        if self.max_surge + self.max_unavailable < 1:
            raise ValueError("rollout: maxSurge and maxUnavailable cannot both be 0 (the rollout could not start)")
        return self


class Toleration(_Spec):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class EnvVar(_Spec):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = None


ROLES = ("prefill", "decode")
ADAPTERS_MOUNT = "/adapters"


class AdapterClaim(_Spec):
    claim_name: str = Field(min_length=1)
    path: str | None = None  # inside the claim (its subPath)


class AdapterSource(_Spec):
    """A PEFT adapter directory: `path` on the model volume (relative) or in the image
    (absolute), or a PersistentVolumeClaim of its own."""

    path: str | None = Field(None, min_length=1)
    pvc: AdapterClaim | None = None

    @model_validator(mode="after")
    def _one_source(self) -> AdapterSource:
        if (self.path is None) == (self.pvc is None):
            raise ValueError("set exactly one of source.path and source.pvc")
        return self


class LoRAAdapter(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
    source: AdapterSource


class Pool(_Spec):
    """One side of a disaggregated model; resources and engine default to the spec's own."""

    replicas: int = Field(1, ge=0, le=1000)
    resources: Resources | None = None
    engine: EngineSettings | None = None
    autoscaling: Autoscaling = Field(default_factory=lambda: Autoscaling.model_validate({}))


class Disaggregation(_Spec):
    """Prompts on the prefill pool, tokens on the decode pool, KV blocks pulled between them."""

    prefill: Pool = Field(default_factory=lambda: Pool.model_validate({}))
    decode: Pool = Field(default_factory=lambda: Pool.model_validate({}))


class InferenceDeploymentSpec(_Spec):
    model: ModelSource
    model_cache: ModelCache | None = None
    kv_cache: KVCacheTier | None = None
    served_model_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
    image: str | None = Field(None, min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    replicas: int = Field(1, ge=0, le=1000)
    resources: Resources = Field(default_factory=lambda: Resources.model_validate({}))
    engine: EngineSettings = Field(default_factory=lambda: EngineSettings.model_validate({}))
    autoscaling: Autoscaling = Field(default_factory=lambda: Autoscaling.model_validate({}))
    rollout: Rollout = Field(default_factory=lambda: Rollout.model_validate({}))
    node_selector: dict[str, str] = {}
    tolerations: list[Toleration] = []
    env: list[EnvVar] = []
    disaggregation: Disaggregation | None = None
    lora_adapters: list[LoRAAdapter] = []

    @model_validator(mode="after")
    def _devices(self) -> InferenceDeploymentSpec:
        if self.resources.gpus and self.resources.gpus < self.engine.tensor_parallel_size:
            raise ValueError("engine.tensorParallelSize: at most resources.gpus when GPUs are requested")
        names = [adapter.name for adapter in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ValueError("loraAdapters: adapter names must be unique")
        if any(a.source.path and not a.source.path.startswith("/") for a in self.lora_adapters) and (
            self.model.volume is None
        ):
            raise ValueError("loraAdapters: a relative source.path lies on model.volume, which is not set")
        if self.disaggregation is not None:
            if self.autoscaling.enabled:
                raise ValueError("autoscaling: with disaggregation, autoscale each pool (disaggregation.*.autoscaling)")
            prefill, decode = (self.pool(role).engine for role in ROLES)
            if (prefill.block_size, prefill.dtype) != (decode.block_size, decode.dtype):
                raise ValueError(
                    "disaggregation: the prefill and decode pools need the same engine.blockSize and engine.dtype "
                    "(their KV blocks move between them)"
                )
        return self

    def pool(self, role: str) -> InferenceDeploymentSpec:
        """The spec of one pool of a disaggregated model, as if it were a model of its own."""
        assert self.disaggregation is not None, "only a disaggregated model has pools"
        pool: Pool = getattr(self.disaggregation, role)
        return self.model_copy(
            update={
                "replicas": pool.replicas,
                "resources": pool.resources or self.resources,
                "engine": pool.engine or self.engine,
                "autoscaling": pool.autoscaling,
                "disaggregation": None,
            }
        )


class InvalidSpec(ValueError):
    """The spec breaks the schema; `field` is the camelCase path of the first problem."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def parse_spec(spec: dict[str, Any]) -> InferenceDeploymentSpec:
    """The validated spec, or InvalidSpec naming the first offending field."""
    try:
        return InferenceDeploymentSpec.model_validate(spec)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise InvalidSpec(f"spec.{field}" if field else "spec", message) from None
