"""The replica record: how an engine replica tells the fleet how much KV room it has.

Each replica writes one record per served model to Redis, as JSON under
`pagefleet:replica:<model>:<replica_id>`, with a TTL of a few seconds, refreshed at least
every `PUBLISH_INTERVAL_S` (and at once on a large change). A replica that dies stops
refreshing and its record expires by itself; one that shuts down cleanly deletes it.
See docs/redis-protocol.md.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

KEY_PREFIX = "pagefleet:replica:"
PUBLISH_INTERVAL_S = 0.5
RECORD_TTL_S = 3.0


class ReplicaRecord(BaseModel):
    replica_id: str
    model: str = Field(description="the served model name clients send as `model`")
    url: str = Field(description="base URL of the replica's OpenAI API, e.g. http://10.0.0.5:8000")
    free_blocks: int = Field(ge=0, description="KV blocks an allocation may take now")
    free_tokens: int | None = Field(
        None,
        ge=0,
        description="the longest context a new request could be admitted with now, in every KV cache group "
        "(sliding-window layers need only their window's blocks); None from replicas that do not say",
    )
    total_blocks: int = Field(gt=0)
    block_size: int = Field(gt=0, description="token slots per block")
    running: int = Field(ge=0, description="requests being computed")
    waiting: int = Field(ge=0, description="requests queued or preempted")
    max_model_len: int = Field(gt=0)
    restarts: int = Field(0, ge=0, description="times its supervisor restarted this replica after it died")
    role: Literal["prefill", "decode", "both"] = Field(
        "both", description="prefill/decode disaggregation: what this replica does (docs/disaggregation.md)"
    )
    waiting_prompt_tokens: int = Field(
        0, ge=0, description="prompt tokens of its queued requests that its prefix cache did not hold when they came"
    )
    prefill_tokens_per_s: float = Field(
        0.0, ge=0, description="prompt tokens it computes per second (a moving average; 0 until measured)"
    )
    adapters: list[str] = Field(default_factory=list, description="LoRA adapters it serves now, by name")
    free_state_slots: int | None = Field(
        None,
        ge=0,
        description="a model with state layers (linear attention, Mamba): state-cache slots free now, one per "
        "sequence it can still start; None for other models",
    )
    total_state_slots: int | None = Field(None, ge=0, description="its state-cache slots; None for other models")
    timestamp: float = Field(default_factory=time.time, description="Unix time of this report")

    @property
    def room_blocks(self) -> int:
        """Room for a new request, in blocks of its context: what routing ranks on (none
        while a model with state layers has no free state slot: a new request would wait)."""
        if self.free_state_slots == 0:
            return 0
        return self.free_blocks if self.free_tokens is None else self.free_tokens // self.block_size

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks

    def is_fresh(self, now: float | None = None, ttl: float = RECORD_TTL_S) -> bool:
        return (now if now is not None else time.time()) - self.timestamp <= ttl


def record_key(model: str, replica_id: str) -> str:
    return f"{KEY_PREFIX}{model}:{replica_id}"


CATALOG_PREFIX = "pagefleet:lora:"


def catalog_key(model: str) -> str:
    """The hash of the LoRA adapters known for a base model: adapter name -> its path."""
    return f"{CATALOG_PREFIX}{model}"


def model_pattern(model: str = "*") -> str:
    """A SCAN pattern for one model's records (or every model's)."""
    return f"{KEY_PREFIX}{model}:*"
