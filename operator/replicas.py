"""The operator's view of a model's replicas in Redis (the records of protocol/replica.py)."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as redis
from pydantic import ValidationError

from pagefleet.protocol.replica import ReplicaRecord, model_pattern


@dataclass(frozen=True, slots=True)
class KVSummary:
    """What the model's live replicas report, together."""

    reporting_replicas: int
    free_blocks: int
    total_blocks: int
    mean_utilization: float  # the mean of each replica's used fraction of blocks
    waiting_requests: int
    waiting_prompt_tokens: int = 0

    @classmethod
    def of(cls, records: list[ReplicaRecord]) -> KVSummary:
        if not records:
            return cls(0, 0, 0, 0.0, 0)
        return cls(
            reporting_replicas=len(records),
            free_blocks=sum(r.free_blocks for r in records),
            total_blocks=sum(r.total_blocks for r in records),
            mean_utilization=sum(r.kv_usage for r in records) / len(records),
            waiting_requests=sum(r.waiting for r in records),
            waiting_prompt_tokens=sum(r.waiting_prompt_tokens for r in records),
        )

    @classmethod
    def of_role(cls, records: list[ReplicaRecord], role: str | None) -> KVSummary:
        """The summary of one pool's replicas (None: all of them)."""
        return cls.of([r for r in records if role is None or r.role == role])


async def read_records(client: redis.Redis, model: str) -> list[ReplicaRecord]:
    """The fresh records of `model` (stale or unreadable ones are skipped)."""
    keys = [key async for key in client.scan_iter(match=model_pattern(model), count=100)]
    if not keys:
        return []
    records = []
    for raw in await client.mget(keys):
        if raw is None:
            continue
        try:
            record = ReplicaRecord.model_validate_json(raw)
        except ValidationError:
            continue
        if record.model == model and record.is_fresh():
            records.append(record)
    return records


async def remove_records(client: redis.Redis, model: str) -> int:
    """Delete every record of `model`; how many there were."""
    keys = [key async for key in client.scan_iter(match=model_pattern(model), count=100)]
    return int(await client.delete(*keys)) if keys else 0
