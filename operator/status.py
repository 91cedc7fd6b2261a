"""`.status` of an InferenceDeployment, from its Deployment and its replicas' KV reports.

Pure: the reconciler passes what it read and writes only the fields that changed, so a
resource whose world did not move gets no write at all.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from pagefleet.operator.replicas import KVSummary
from pagefleet.protocol.replica import ReplicaRecord

CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "KVCachePressure")


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str


def now_text() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _deployment_condition(deployment: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for condition in deployment.get("status", {}).get("conditions", []) or []:
        if condition.get("type") == kind:
            return dict(condition)
    return None


def conditions_for(
    desired: int, deployment: dict[str, Any], kv: KVSummary, target_utilization: float
) -> list[Condition]:
    state = deployment.get("status", {}) or {}
    ready, updated = state.get("readyReplicas", 0) or 0, state.get("updatedReplicas", 0) or 0
    generation_seen = state.get("observedGeneration", 0) >= deployment.get("metadata", {}).get("generation", 0)
    if desired == 0:
        ready_condition = Condition("Ready", "True", "ScaledToZero", "no replicas are wanted")
    elif ready >= desired:
        ready_condition = Condition("Ready", "True", "AllReplicasReady", f"{ready}/{desired} replicas are ready")
    else:
        ready_condition = Condition("Ready", "False", "ReplicasNotReady", f"{ready}/{desired} replicas are ready")
    if generation_seen and updated >= desired and ready >= desired:
        progressing = Condition("Progressing", "False", "RolloutComplete", "every replica runs the current spec")
    else:
        progressing = Condition("Progressing", "True", "RollingOut", f"{updated}/{desired} replicas updated")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    available = _deployment_condition(deployment, "Available")
    if failure is not None and failure.get("status") == "True":
        degraded = Condition("Degraded", "True", failure.get("reason", "ReplicaFailure"), failure.get("message", ""))
    elif available is not None and available.get("status") == "False":
        degraded = Condition("Degraded", "True", available.get("reason", "Unavailable"), available.get("message", ""))
    else:
        degraded = Condition("Degraded", "False", "NoFailures", "no replica failure reported")
    if kv.reporting_replicas == 0:
        pressure = Condition("KVCachePressure", "Unknown", "NoReports", "no replica reports its KV cache")
    elif kv.waiting_requests > 0:
        pressure = Condition("KVCachePressure", "True", "RequestsWaiting", f"{kv.waiting_requests} requests wait")
    elif kv.mean_utilization > target_utilization:
        message = f"mean KV utilization {kv.mean_utilization:.0%} is above the target {target_utilization:.0%}"
        pressure = Condition("KVCachePressure", "True", "HighUtilization", message)
    else:
        message = f"mean KV utilization {kv.mean_utilization:.0%} (target {target_utilization:.0%})"
        pressure = Condition("KVCachePressure", "False", "WithinTarget", message)
    return [ready_condition, progressing, degraded, pressure]


def invalid_spec_conditions(message: str) -> list[Condition]:
    return [
        Condition("Ready", "False", "InvalidSpec", message),
        Condition("Progressing", "False", "InvalidSpec", "nothing is rolled out until the spec is fixed"),
    ]


def merge_conditions(
    previous: list[dict[str, Any]], new: list[Condition], generation: int | None
) -> list[dict[str, Any]]:
    """The conditions list with `new` applied; a condition's lastTransitionTime moves only
    when its status does, and conditions not in `new` are kept."""
    by_type = {c.get("type"): dict(c) for c in previous or []}
    for condition in new:
        old = by_type.get(condition.type, {})
        entry = {
            "type": condition.type,
            "status": condition.status,
            "reason": condition.reason,
            "message": condition.message,
            "lastTransitionTime": old.get("lastTransitionTime") if old.get("status") == condition.status else None,
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        entry["lastTransitionTime"] = entry["lastTransitionTime"] or now_text()
        by_type[condition.type] = entry
    return [by_type[t] for t in CONDITION_TYPES if t in by_type]


def changed_fields(current: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """The top-level status fields of `wanted` that differ from `current`."""
    return {key: value for key, value in wanted.items() if current.get(key) != value}


def combined_deployment(deployments: list[dict[str, Any]]) -> dict[str, Any]:
    """One Deployment's worth of status for several (a disaggregated model's pools): counts
    added, conditions of each, rolled out only when each is."""
    counts = ("replicas", "readyReplicas", "updatedReplicas")
    states = [d.get("status", {}) or {} for d in deployments]
    rolled_out = all(
        (s.get("observedGeneration", 0) or 0) >= (d.get("metadata", {}).get("generation", 0) or 0)
        for d, s in zip(deployments, states, strict=True)
    )
    return {
        "metadata": {"generation": 0 if rolled_out else 1},
        "status": {
            **{name: sum(s.get(name, 0) or 0 for s in states) for name in counts},
            "observedGeneration": 0,
            "conditions": [c for s in states for c in s.get("conditions", []) or []],
        },
    }


def pool_status(desired: int, deployment: dict[str, Any], kv: KVSummary) -> dict[str, Any]:
    state = deployment.get("status", {}) or {}
    ready = state.get("readyReplicas", 0) or 0
    return {
        "replicas": state.get("replicas", 0) or 0,
        "readyReplicas": ready,
        "readyText": f"{ready}/{desired}",
        "kv": kv_status(kv),
        "waitingPromptTokens": kv.waiting_prompt_tokens,
    }


def adapters_served(records: list[ReplicaRecord], pools: list[str]) -> dict[str, list[str]]:
    """Per pool ("engine" for a colocated model, else "prefill"/"decode"), the LoRA adapters
    its live replicas serve."""
    served: dict[str, set[str]] = {pool: set() for pool in pools}
    for record in records:
        pool = "engine" if "engine" in served else record.role
        if pool in served:
            served[pool].update(record.adapters)
    return {pool: sorted(names) for pool, names in served.items()}


def kv_status(kv: KVSummary) -> dict[str, Any]:
    return {
        "freeBlocks": kv.free_blocks,
        "totalBlocks": kv.total_blocks,
        "utilization": round(kv.mean_utilization, 3),
        "utilizationText": f"{kv.mean_utilization:.0%}" if kv.reporting_replicas else "-",
        "waitingRequests": kv.waiting_requests,
        "reportingReplicas": kv.reporting_replicas,
    }
