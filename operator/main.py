"""The kopf registration: which handler runs when, and how kopf keeps its books.

Handlers only translate between kopf and reconcile.py / autoscale.py: a change, a resume or
the periodic timer runs the same reconcile; the timer also runs the autoscaler; deletion
removes the model's replica records from Redis before the finalizer lets go. kopf's own
bookkeeping goes to `pagefleet.io/` annotations, so `.status` holds only our fields.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import kopf
import redis.asyncio as redis
from redis.exceptions import RedisError

from pagefleet.operator.autoscale import ScaleHistory, decide
from pagefleet.operator.kube import INFERENCE_DEPLOYMENTS, ApiError, KubeApi
from pagefleet.operator.manifests import GROUP, PLURAL, VERSION, Owner
from pagefleet.operator.reconcile import Outcome, Runtime, reconcile
from pagefleet.operator.replicas import remove_records
from pagefleet.operator.settings import OperatorSettings
from pagefleet.operator.spec import InferenceDeploymentSpec
from pagefleet.operator.status import now_text

FINALIZER = "pagefleet.io/finalizer"
RESOURCE = (GROUP, VERSION, PLURAL)


def _login(settings: kopf.OperatorSettings | None = None) -> kopf.ConnectionInfo | None:
    """In a pod: its service account; elsewhere: $KUBECONFIG or ~/.kube/config."""
    settings = settings or kopf.OperatorSettings()
    return kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)


def _backoff(retry: int) -> float:
    return float(min(60, 2 ** min(retry, 6)))


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    runtime = Runtime(settings, KubeApi(_login), redis.from_url(settings.redis_url, socket_timeout=2.0))

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pagefleet.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="pagefleet.io", key="last-handled-configuration"
        )
        settings.posting.level = logging.WARNING  # kopf's log lines become events only from warnings up
        settings.scanning.disabled = True  # the resource is known: no watching of CRDs or namespaces
        settings.execution.max_workers = 4

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        await runtime.kube.close()
        await runtime.redis.aclose()

    @kopf.on.login(registry=registry)
    def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
        return _login(settings)

    async def run_reconcile(body: kopf.Body, patch: kopf.Patch, retry: int, logger: Any) -> Outcome:
        try:
            outcome = await reconcile(runtime, body)
        except ApiError as error:
            if error.is_transient:
                raise kopf.TemporaryError(str(error), delay=_backoff(retry)) from error
            raise kopf.PermanentError(str(error)) from error
        for action in outcome.applied:
            logger.info(action)
        if outcome.invalid is not None and outcome.status_patch:
            kopf.event(body, type="Warning", reason="InvalidSpec", message=str(outcome.invalid))
        for key, value in outcome.status_patch.items():
            patch.status[key] = value
        return outcome

    @kopf.on.resume(*RESOURCE, registry=registry)
    @kopf.on.create(*RESOURCE, registry=registry)
    @kopf.on.update(*RESOURCE, registry=registry)
    async def changed(*, body: kopf.Body, patch: kopf.Patch, retry: int, logger: Any, **_: Any) -> None:
        await run_reconcile(body, patch, retry, logger)

    @kopf.timer(*RESOURCE, interval=settings.reconcile_interval_s, registry=registry)
    async def periodic(*, body: kopf.Body, patch: kopf.Patch, logger: Any, **kwargs: Any) -> None:
        outcome = await run_reconcile(body, patch, kwargs.get("retry", 0), logger)
        spec = outcome.spec
        if spec is None:
            return
        if spec.autoscaling.enabled:
            await autoscale(body, patch, spec, outcome.kv, None, logger)
        for role, kv in outcome.pools.items():  # a disaggregated model: each pool on its own pressure
            if spec.pool(role).autoscaling.enabled:
                await autoscale(body, patch, spec.pool(role), kv, role, logger)

    async def autoscale(
        body: kopf.Body, patch: kopf.Patch, spec: InferenceDeploymentSpec, kv: Any, role: str | None, logger: Any
    ) -> None:
        """Scale the model (`role` None, through the scale subresource) or one of its pools
        (the decode pool on KV pressure, the prefill pool on queued prompt tokens)."""
        owner = Owner.of(body)
        now = time.monotonic()
        key = f"{owner.namespace}/{owner.name}" + (f"/{role}" if role else "")
        history = runtime.histories.setdefault(key, ScaleHistory(started_s=now))
        current = spec.replicas
        decision = decide(current, kv, spec.autoscaling, history, now, prefill=role == "prefill")
        if decision.changes(current):
            if role is None:
                scale = {"spec": {"replicas": decision.replicas}}
                await runtime.kube.patch(INFERENCE_DEPLOYMENTS, owner.namespace, owner.name, scale, sub="scale")
            else:
                pool = {"spec": {"disaggregation": {role: {"replicas": decision.replicas}}}}
                await runtime.kube.patch(INFERENCE_DEPLOYMENTS, owner.namespace, owner.name, pool)
            patch.status["lastScaleTime"] = now_text()
        if decision.changes(current) or decision.reason != history.last_reason:
            pool_name = f"{role} pool: " if role else ""
            message = f"{pool_name}{current} -> {decision.replicas} replicas: {decision.message}"
            if decision.reason not in ("Steady", "NoReports"):
                kopf.event(body, type="Normal", reason=decision.reason, message=message)
            logger.info("autoscaler: %s (%s)", message, decision.reason)
        history.last_reason = decision.reason

    @kopf.on.delete(*RESOURCE, registry=registry)
    async def deleted(*, spec: kopf.Spec, name: str, namespace: str | None, retry: int, logger: Any, **_: Any) -> None:
        for key in [k for k in runtime.histories if k == f"{namespace}/{name}" or k.startswith(f"{namespace}/{name}/")]:
            runtime.histories.pop(key)
        model = spec.get("servedModelName") or name
        try:
            removed = await remove_records(runtime.redis, model)
        except (RedisError, OSError) as error:
            message = f"cannot reach Redis to remove {model}'s records: {error}"
            raise kopf.TemporaryError(message, delay=_backoff(retry)) from error
        logger.info("removed %d replica records of %s from Redis", removed, model)

    return registry


async def run_operator(
    settings: OperatorSettings,
    stop_flag: threading.Event | None = None,
    ready_flag: threading.Event | None = None,
) -> None:
    """Run until stopped (a signal, or `stop_flag` in tests); one replica, no peering."""
    registry = build_registry(settings)
    health = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    await kopf.operator(
        registry=registry,
        standalone=True,
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        liveness_endpoint=health,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
