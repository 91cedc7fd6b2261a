"""The kopf registration: which handler runs when, and how kopf keeps its books.

Handlers are module-level functions, as in kopf's own examples; what they share (the API
client, Redis, autoscaling histories, metrics) rides in kopf's memo, made once by
`run_operator`, and `build_registry` only registers them. They only translate between
kopf and reconcile.py / autoscale.py: a change, a resume or the periodic timer runs the
same reconcile; the timer also runs the autoscaler; deletion removes the model's replica
records from Redis before the finalizer lets go. kopf's own bookkeeping goes to
`pagefleet.io/` annotations, so `.status` holds only our fields, and `_write_status` is
its one writer.

One writer per resource: the change handlers and the timer reconcile a resource under its
lock, and the timer skips a period in which a handler holds it (the handler does the same
work from newer state). The timer also stops as soon as kopf asks it to (the resource is
being deleted, or the operator exits), cancelling a call in flight, so that neither a
deletion nor a shutdown waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import kopf
import redis.asyncio as redis
from redis.exceptions import RedisError

from pagefleet.operator.autoscale import ScaleHistory, decide
from pagefleet.operator.kube import INFERENCE_DEPLOYMENTS, ApiError, KubeApi
from pagefleet.operator.manifests import GROUP, PLURAL, VERSION, Owner, served_model_name
from pagefleet.operator.metrics import OperatorMetrics
from pagefleet.operator.reconcile import Outcome, Runtime, reconcile
from pagefleet.operator.replicas import remove_records
from pagefleet.operator.settings import OperatorSettings
from pagefleet.operator.spec import InferenceDeploymentSpec
from pagefleet.operator.status import now_text
from pagefleet.protocol.demand import demand_key, read_demand, scalable_key

FINALIZER = "pagefleet.io/finalizer"
RESOURCE = (GROUP, VERSION, PLURAL)
T = TypeVar("T")


def _login(settings: kopf.OperatorSettings | None = None) -> kopf.ConnectionInfo | None:
    """In a pod: its service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    settings = settings or kopf.OperatorSettings()
    return kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)


def _backoff(retry: int) -> float:
    return float(min(60, 2 ** min(retry, 6)))


@dataclass(slots=True)
class Shared:
    """What the handlers share, in kopf's memo (`memo.shared`): made by `run_operator`."""

    runtime: Runtime
    metrics: OperatorMetrics


def _shared(memo: kopf.Memo) -> Shared:
    shared: Shared = memo.shared
    return shared


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """kopf's bookkeeping in `pagefleet.io/` annotations; the metrics server, if asked."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pagefleet.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="pagefleet.io", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # kopf's log lines become events only from warnings up
    settings.scanning.disabled = True  # the resource is known: no watching of CRDs or namespaces
    settings.execution.max_workers = 4
    settings.background.instant_exit_timeout = 2.0  # the timer exits at once when told to (below)
    shared = _shared(memo)
    if shared.runtime.settings.metrics_port:
        shared.metrics.serve(shared.runtime.settings.metrics_port)


async def close(memo: kopf.Memo, **_: Any) -> None:
    runtime, metrics = _shared(memo).runtime, _shared(memo).metrics
    runtime.closing = True  # a timer kopf still fires from now on does nothing
    for lock in list(runtime.locks.values()):  # reconciles in flight end before their client closes
        async with lock:
            pass
    _cancel_late_timers()
    metrics.close()
    await runtime.kube.close()
    await runtime.redis.aclose()


def _cancel_late_timers() -> None:
    """Cancel the timers kopf started for a resource whose processing was in flight when the
    operator was told to stop: its daemon killer has already gone, so nothing would stop
    them, and kopf would wait 5 s for them as hung tasks before exiting. (kopf names a
    timer's task "runner of <handler id>"; if it ever does not, the exit is only slower.)"""
    late = f"runner of {periodic.__name__}"
    for task in asyncio.all_tasks():
        if task.get_name() == late:
            task.cancel()


def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
    return _login(settings)


async def changed(*, body: kopf.Body, patch: kopf.Patch, retry: int, logger: Any, memo: kopf.Memo, **_: Any) -> None:
    """A resource created, changed, or found at start: reconcile it."""
    shared = _shared(memo)
    async with shared.runtime.lock(Owner.of(body).key):
        outcome = await _reconcile(shared, body, retry, logger)
        _write_status(patch, outcome.status_patch)


async def periodic(*, body: kopf.Body, patch: kopf.Patch, logger: Any, memo: kopf.Memo, **kwargs: Any) -> None:
    """Every period: reconcile, then autoscale on the KV pressure the replicas report."""
    stopped: kopf.DaemonStopped = kwargs["stopped"]  # set when the resource goes or the operator exits
    shared = _shared(memo)
    lock = shared.runtime.lock(Owner.of(body).key)
    if shared.runtime.closing or lock.locked():
        logger.debug("the operator exits, or a handler is reconciling this resource: the timer skips a period")
        return
    async with lock:
        status = await _unless_stopped(stopped, _reconcile_and_autoscale(shared, body, logger))
        if status is not None:
            _write_status(patch, status)


async def deleted(
    *, spec: kopf.Spec, name: str, namespace: str | None, retry: int, logger: Any, memo: kopf.Memo, **_: Any
) -> None:
    """Forget the resource, and remove its model's replica records from Redis before the
    finalizer lets go."""
    runtime, metrics = _shared(memo).runtime, _shared(memo).metrics
    for key in [k for k in runtime.histories if k == f"{namespace}/{name}" or k.startswith(f"{namespace}/{name}/")]:
        runtime.histories.pop(key)
    runtime.locks.pop(f"{namespace}/{name}", None)
    metrics.forget(namespace or "", name)
    model = spec.get("servedModelName") or name
    try:
        removed = await remove_records(runtime.redis, model)
        await runtime.redis.delete(scalable_key(model))
    except (RedisError, OSError) as error:
        message = f"cannot reach Redis to remove {model}'s records: {error}"
        raise kopf.TemporaryError(message, delay=_backoff(retry)) from error
    logger.info("removed %d replica records of %s from Redis", removed, model)


def _write_status(patch: kopf.Patch, status: dict[str, Any]) -> None:
    """The one place `.status` is written: what a reconcile (and the autoscaler) decided."""
    for key, value in status.items():
        patch.status[key] = value


async def _reconcile(shared: Shared, body: kopf.Body, retry: int, logger: Any) -> Outcome:
    """Reconcile, count it, log what it applied; the kopf error a failure calls for."""
    owner, metrics = Owner.of(body), shared.metrics
    try:
        outcome = await reconcile(shared.runtime, body)
    except ApiError as error:
        metrics.reconciles.labels(owner.namespace, owner.name, "error").inc()
        if error.is_transient:
            raise kopf.TemporaryError(str(error), delay=_backoff(retry)) from error
        raise kopf.PermanentError(str(error)) from error
    metrics.reconciles.labels(owner.namespace, owner.name, "ok").inc()
    if outcome.spec is not None:
        spec = outcome.spec
        pools = {role: (spec.pool(role).replicas, kv) for role, kv in outcome.pools.items()} or {
            "": (spec.replicas, outcome.kv)
        }
        for pool, (replicas, kv) in pools.items():
            metrics.replicas.labels(owner.namespace, owner.name, pool).set(replicas)
            metrics.kv_utilization.labels(owner.namespace, owner.name, pool).set(kv.mean_utilization)
    for action in outcome.applied:
        logger.info(action)
    if outcome.invalid is not None and outcome.status_patch:
        kopf.event(body, type="Warning", reason="InvalidSpec", message=str(outcome.invalid))
    return outcome


async def _reconcile_and_autoscale(shared: Shared, body: kopf.Body, logger: Any) -> dict[str, Any]:
    """The status to write: the reconcile's, and when the autoscaler scaled, the time."""
    outcome = await _reconcile(shared, body, 0, logger)
    status = dict(outcome.status_patch)
    spec = outcome.spec
    if spec is None:
        return status
    scaled = False
    if spec.autoscaling.enabled:
        scaled |= await _autoscale(shared, body, spec, outcome.kv, None, logger)
    for role, kv in outcome.pools.items():  # a disaggregated model: each pool on its own pressure
        if spec.pool(role).autoscaling.enabled:
            scaled |= await _autoscale(shared, body, spec.pool(role), kv, role, logger)
    if scaled:
        status["lastScaleTime"] = now_text()
    return status


async def _autoscale(
    shared: Shared, body: kopf.Body, spec: InferenceDeploymentSpec, kv: Any, role: str | None, logger: Any
) -> bool:
    """Scale the model (`role` None, through the scale subresource) or one of its pools
    (the decode pool on KV pressure, the prefill pool on queued prompt tokens); True if
    it changed the replica count."""
    runtime, metrics, owner = shared.runtime, shared.metrics, Owner.of(body)
    now = time.monotonic()
    key = owner.key + (f"/{role}" if role else "")
    history = runtime.histories.setdefault(key, ScaleHistory(started_s=now, started_at=time.time()))
    current = history.current(spec.replicas, now)
    last_request = None
    if spec.autoscaling.min_replicas == 0:
        try:
            last_request = read_demand(await runtime.redis.get(demand_key(served_model_name(owner, spec))))
        except (RedisError, OSError) as error:  # without the demand, nothing is scaled to or from zero
            logger.warning("autoscaler: cannot read the demand from Redis (%s); not scaling", error)
            return False
    prefill = role == "prefill"
    decision = decide(current, kv, spec.autoscaling, history, now, prefill, last_request, wall_now=time.time())
    if decision.changes(current):
        history.patched = (current, decision.replicas, now)
        metrics.scaling_events.labels(owner.namespace, owner.name, role or "", decision.reason).inc()
        # The decision is the desired count from now on: the next reconcile may still read a
        # body from before the patch (kopf's watch lags under load) and would say the old one.
        metrics.replicas.labels(owner.namespace, owner.name, role or "").set(decision.replicas)
        if role is None:
            scale = {"spec": {"replicas": decision.replicas}}
            await runtime.kube.patch(INFERENCE_DEPLOYMENTS, owner.namespace, owner.name, scale, sub="scale")
        else:
            pool = {"spec": {"disaggregation": {role: {"replicas": decision.replicas}}}}
            await runtime.kube.patch(INFERENCE_DEPLOYMENTS, owner.namespace, owner.name, pool)
    if decision.changes(current) or decision.reason != history.last_reason:
        pool_name = f"{role} pool: " if role else ""
        message = f"{pool_name}{current} -> {decision.replicas} replicas: {decision.message}"
        if decision.reason not in ("Steady", "NoReports"):
            kopf.event(body, type="Normal", reason=decision.reason, message=message)
        logger.info("autoscaler: %s (%s)", message, decision.reason)
    history.last_reason = decision.reason
    return decision.changes(current)


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """The handlers above, registered; only the timer's period comes from `settings`."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.cleanup(registry=registry)(close)
    kopf.on.login(registry=registry)(login)
    for event in (kopf.on.resume, kopf.on.create, kopf.on.update):
        event(*RESOURCE, registry=registry)(changed)
    kopf.timer(*RESOURCE, interval=settings.reconcile_interval_s, registry=registry)(periodic)
    kopf.on.delete(*RESOURCE, registry=registry)(deleted)
    return registry


async def _unless_stopped(stopped: kopf.DaemonStopped, work: Awaitable[T]) -> T | None:
    """Run `work` until it ends or kopf sets `stopped`; then cancel it, mid-call if need be
    (a timer's reconcile is repeated next period anyway)."""
    task = asyncio.ensure_future(work)

    async def stop_requested() -> None:
        await stopped.wait()

    waiter = asyncio.ensure_future(stop_requested())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, waiter):
            pending.cancel()
        await asyncio.gather(task, waiter, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()  # its error, if any, is the timer's


async def run_operator(
    settings: OperatorSettings,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
) -> None:
    """Run until stopped (a signal, or `stop_flag` in tests); one replica, no peering."""
    runtime = Runtime(settings, KubeApi(_login), redis.from_url(settings.redis_url, socket_timeout=2.0))
    memo = kopf.Memo(shared=Shared(runtime, OperatorMetrics()))
    health = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    await kopf.operator(
        registry=build_registry(settings),
        memo=memo,
        standalone=True,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        liveness_endpoint=health,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
