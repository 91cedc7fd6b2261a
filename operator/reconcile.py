"""One idempotent reconcile of an InferenceDeployment.

validate the spec -> build the desired objects (manifests.py) -> apply them -> compute the
status. Applying is get, then create if missing or merge-patch if any field we set differs
from what the cluster holds; fields the cluster adds (defaults, status) are left alone, so
a second reconcile of an unchanged resource writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as redis
from redis.exceptions import RedisError

from pagefleet.operator import manifests, status
from pagefleet.operator.autoscale import ScaleHistory
from pagefleet.operator.kube import DEPLOYMENTS, KINDS_BY_API_KIND, ApiError, KubeApi
from pagefleet.operator.replicas import KVSummary, read_records
from pagefleet.operator.settings import OperatorSettings
from pagefleet.operator.spec import ROLES, InferenceDeploymentSpec, InvalidSpec, parse_spec
from pagefleet.protocol.demand import scalable_key

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What every handler shares: settings, the API client, Redis, autoscaling histories."""

    settings: OperatorSettings
    kube: KubeApi
    redis: redis.Redis
    histories: dict[str, ScaleHistory] = field(default_factory=dict)  # by namespace/name
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)  # by namespace/name: one reconcile at a time
    closing: bool = False  # the operator exits: no new periodic work

    def lock(self, key: str) -> asyncio.Lock:
        """The lock every handler and the timer hold while they reconcile one resource."""
        return self.locks.setdefault(key, asyncio.Lock())


@dataclass(slots=True)
class Outcome:
    """What a reconcile did: the objects it created or patched, and the status to write."""

    spec: InferenceDeploymentSpec | None
    applied: list[str]
    status_patch: dict[str, Any]
    kv: KVSummary
    invalid: InvalidSpec | None = None
    pools: dict[str, KVSummary] = field(default_factory=dict)  # a disaggregated model's, by role


def is_subset(wanted: Any, actual: Any) -> bool:
    """Whether every field of `wanted` has the same value in `actual` (quantities compared
    as text: the API server returns the integer 1 as "1")."""
    if isinstance(wanted, dict):
        if not isinstance(actual, dict):
            return False
        return all(
            (value is None and key not in actual) or is_subset(value, actual.get(key)) for key, value in wanted.items()
        )
    if isinstance(wanted, list):
        return (
            isinstance(actual, list)
            and len(wanted) == len(actual)
            and all(is_subset(w, a) for w, a in zip(wanted, actual, strict=True))
        )
    if isinstance(wanted, bool) or isinstance(actual, bool):
        return wanted is actual
    return wanted == actual or (wanted is not None and actual is not None and str(wanted) == str(actual))


def _with_removals(desired: dict[str, Any]) -> dict[str, Any]:
    """Merge-patch removes only what is null: optional pod fields the spec dropped."""
    if desired["kind"] == "Deployment":
        pod = desired["spec"]["template"]["spec"]
        pod.setdefault("nodeSelector", None)
        pod.setdefault("tolerations", None)
    return desired


async def apply(kube: KubeApi, desired: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """(the object as the cluster now holds it, "created"/"patched" or None if untouched)."""
    kind = KINDS_BY_API_KIND[desired["kind"]]
    meta = desired["metadata"]
    current = await kube.get(kind, meta["namespace"], meta["name"])
    if current is None:
        try:
            return await kube.create(kind, meta["namespace"], desired), "created"
        except ApiError as error:
            if error.status != 409:
                raise
            # Created by someone else since our read (another operator replica, a user):
            # it exists, so this is an update like any other.
            current = await kube.get(kind, meta["namespace"], meta["name"])
            if current is None:
                raise
    desired = _with_removals(desired)
    if is_subset(desired, current):
        return current, None
    return await kube.patch(kind, meta["namespace"], meta["name"], desired), "patched"


async def reconcile(runtime: Runtime, body: Any) -> Outcome:
    """Bring one resource's objects to its spec; the status fields that changed.

    Raises ApiError (transient or not) and Redis errors; an invalid spec is not an error
    here but an outcome with `invalid` set, conditions saying why and nothing applied.
    """
    owner = manifests.Owner.of(body)
    generation = body["metadata"].get("generation")
    current_status = dict(body.get("status") or {})
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
    except InvalidSpec as invalid:
        conditions = status.merge_conditions(
            current_status.get("conditions", []), status.invalid_spec_conditions(str(invalid)), generation
        )
        wanted = {"conditions": conditions} | ({"observedGeneration": generation} if generation else {})
        return Outcome(None, [], status.changed_fields(current_status, wanted), KVSummary.of([]), invalid)

    applied: list[str] = []
    deployments: dict[str, dict[str, Any]] = {}  # by name
    for desired in manifests.desired_objects(owner, spec, runtime.settings):
        held, action = await apply(runtime.kube, desired)
        name = desired["metadata"]["name"]
        if action is not None:
            applied.append(f"{action} {desired['kind']} {owner.namespace}/{name}")
        if desired["kind"] == "Deployment":
            deployments[name] = held
    applied += await _delete_other_layouts(runtime.kube, owner, spec)
    name = manifests.served_model_name(owner, spec)
    try:
        await _offer_scaling_to_zero(runtime.redis, name, spec)
        records = await read_records(runtime.redis, name)
    except (RedisError, OSError) as error:  # the objects are still applied; KV figures unknown
        logger.warning("cannot read the replicas of %s from Redis: %s", name, error)
        records = []
    roles = manifests.deployment_names(owner, spec)
    pools = {role: KVSummary.of_role(records, role) for role in roles if role is not None}
    served = status.adapters_served(records, [role or "engine" for role in roles])
    kv = pools.get("decode", KVSummary.of(records))  # a disaggregated model's KV lives on its decode pool
    by_role: dict[str | None, dict[str, Any]] = {role: deployments.get(name, {}) for role, name in roles.items()}
    wanted = _wanted_status(owner, spec, by_role, kv, pools, current_status.get("conditions", []), generation)
    if spec.lora_adapters or current_status.get("adapters"):
        wanted["adapters"] = served
    return Outcome(spec, applied, status.changed_fields(current_status, wanted), kv, pools=pools)


async def _offer_scaling_to_zero(client: redis.Redis, model: str, spec: InferenceDeploymentSpec) -> None:
    """Tell the routers whether the model may have no replica (they then hold its requests
    while one starts, instead of answering 404): autoscaling with minReplicas 0."""
    if spec.autoscaling.enabled and spec.autoscaling.min_replicas == 0:
        await client.set(scalable_key(model), "{}")
    else:
        await client.delete(scalable_key(model))


async def _delete_other_layouts(kube: KubeApi, owner: manifests.Owner, spec: InferenceDeploymentSpec) -> list[str]:
    """Delete the engine Deployments of the layout the spec left (colocated <-> pools)."""
    wanted = set(manifests.deployment_names(owner, spec).values())
    deleted = []
    for role in (None, *ROLES):
        name = manifests.deployment_name(owner, role)
        if name in wanted:
            continue
        current = await kube.get(DEPLOYMENTS, owner.namespace, name)
        owners = (current or {}).get("metadata", {}).get("ownerReferences", [])
        if any(ref.get("uid") == owner.uid for ref in owners):
            await kube.delete(DEPLOYMENTS, owner.namespace, name)
            deleted.append(f"deleted Deployment {owner.namespace}/{name}")
    return deleted


def _wanted_status(
    owner: manifests.Owner,
    spec: InferenceDeploymentSpec,
    deployments: dict[str | None, dict[str, Any]],
    kv: KVSummary,
    pools: dict[str, KVSummary],
    conditions: list[dict[str, Any]],
    generation: int | None,
) -> dict[str, Any]:
    """The status of the resource; a disaggregated one's counts are both pools' together,
    with each pool's own under `pools`."""
    desired = {role: spec.pool(role).replicas if role else spec.replicas for role in deployments}
    deployment = status.combined_deployment(list(deployments.values()))
    state = deployment["status"]
    ready = state["readyReplicas"]
    target = spec.pool("decode").autoscaling if pools else spec.autoscaling
    wanted = {
        "servedModelName": manifests.served_model_name(owner, spec),
        "replicas": state["replicas"],
        "readyReplicas": ready,
        "readyText": f"{ready}/{sum(desired.values())}",
        "selector": manifests.selector_text(owner),
        "kv": status.kv_status(kv),
        "conditions": status.merge_conditions(
            conditions,
            status.conditions_for(sum(desired.values()), deployment, kv, target.target_kv_utilization),
            generation,
        ),
    }
    if pools:
        wanted["pools"] = {role: status.pool_status(desired[role], deployments[role], pools[role]) for role in pools}
    if generation is not None:
        wanted["observedGeneration"] = generation
    return wanted
