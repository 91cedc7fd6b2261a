"""Replica count from KV-cache pressure: a pure decision, kept apart from the API calls.

    wanted = ceil(reporting_replicas * mean_kv_utilization / targetKVUtilization)
    wanted = max(wanted, current + 1)         if requests are waiting for room
    wanted = current                          if |utilization / target - 1| <= 10 % and none wait
    wanted = clamp(wanted, minReplicas, maxReplicas)

With `minReplicas: 0` the model also scales to zero and back, on the demand the routers
write in Redis (protocol/demand.py): no request for `idleSeconds` takes every replica away;
a request since then (the gateway holds it) brings one back at once. The KV rules above
never go below one replica by themselves.

Like the Horizontal Pod Autoscaler, recommendations are remembered for the stabilization
windows: a scale-up takes the lowest recommendation of the scale-up window (0 s: at once),
a scale-down the highest of the scale-down window, and only once the operator has watched
for a whole window, so a short lull never removes a replica that is needed again a minute
later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagefleet.operator.replicas import KVSummary
from pagefleet.operator.spec import Autoscaling

TOLERANCE = 0.1


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str  # ScaledUp, ScaledDown, or why nothing changed
    message: str

    def changes(self, current: int) -> bool:
        return self.replicas != current


STALE_BODY_S = 30.0  # how long a body may still show the count from before our patch


@dataclass(slots=True)
class ScaleHistory:
    """Recommendations of one resource, oldest first: (time, replicas)."""

    started_s: float
    recommendations: list[tuple[float, int]] = field(default_factory=list)
    last_reason: str = ""  # events are posted when the reason changes, not every period
    stopped_at: float | None = None  # Unix time it was scaled to zero (None: watched since `started_at`)
    started_at: float = 0.0  # Unix time the operator started watching it, or last scaled it up from zero
    # Our latest patch of the replica count not yet seen in a body: (from, to, monotonic time).
    patched: tuple[int, int, float] | None = None

    def current(self, observed: int, now_s: float) -> int:
        """The replica count to decide from: `observed` (the body's), unless it is a body
        from before our own latest patch (kopf's watch lags under load), which would make
        the same scale-up twice (and count it twice)."""
        if self.patched is not None:
            before, after, at = self.patched
            if observed == before and now_s - at < STALE_BODY_S:
                return after
            self.patched = None
        return observed

    def remember(self, now_s: float, replicas: int, keep_s: float) -> None:
        self.recommendations.append((now_s, replicas))
        self.recommendations = [(t, r) for t, r in self.recommendations if now_s - t <= keep_s]

    def within(self, now_s: float, window_s: float) -> list[int]:
        return [r for t, r in self.recommendations if now_s - t <= window_s]


def recommend(current: int, kv: KVSummary, policy: Autoscaling, prefill: bool = False) -> tuple[int, str]:
    """The replica count the current pressure asks for, within the bounds, and why. A
    prefill pool's pressure is its queued prompt tokens per replica against
    `targetWaitingPromptTokens` (its KV blocks are held only until a decode replica pulls them)."""
    target = policy.target_kv_utilization
    ratio = kv.mean_utilization / target
    if prefill:
        per_replica = kv.waiting_prompt_tokens / max(1, kv.reporting_replicas)
        ratio = per_replica / policy.target_waiting_prompt_tokens
        wanted = current if abs(ratio - 1) <= TOLERANCE else max(1, math.ceil(kv.reporting_replicas * ratio))
        target_tokens = policy.target_waiting_prompt_tokens
        why = f"{per_replica:.0f} queued prompt tokens per replica against a target of {target_tokens}"
    elif kv.waiting_requests > 0:
        wanted = max(math.ceil(kv.reporting_replicas * ratio), current + 1)
        why = f"{kv.waiting_requests} requests wait for KV room"
    elif abs(ratio - 1) <= TOLERANCE:
        wanted, why = current, "KV utilization is within 10% of the target"
    else:
        wanted = math.ceil(kv.reporting_replicas * ratio)
        why = f"mean KV utilization {kv.mean_utilization:.0%} against a target of {target:.0%}"
    floor = max(1, policy.min_replicas)  # to zero only when idle (`from_demand`)
    bounded = min(max(wanted, floor), policy.max_replicas)
    if bounded != wanted:
        why += f" (wanted {wanted}, bounded to {floor}..{policy.max_replicas})"
    return bounded, why


def from_demand(
    current: int, policy: Autoscaling, history: ScaleHistory, last_request: float | None, wall_now: float
) -> Decision | None:
    """A model that may scale to zero: to zero when idle, back to one when asked for since;
    None when the KV rules decide. `last_request` and `wall_now` are Unix times."""
    if current == 0:
        stopped = history.stopped_at if history.stopped_at is not None else history.started_at
        if last_request is not None and last_request > stopped:
            history.started_at = wall_now  # a replica that starts slowly still gets a whole idle period
            return Decision(1, "ScaledUpFromZero", "a request came for a model with no replica")
        return Decision(0, "Idle", "no request since its replicas stopped")
    idle = wall_now - max(last_request or 0.0, history.started_at)
    if idle > policy.idle_seconds:
        history.stopped_at = wall_now
        return Decision(0, "ScaledToZero", f"no request for {idle:.0f} s (idleSeconds {policy.idle_seconds})")
    return None


def decide(
    current: int,
    kv: KVSummary,
    policy: Autoscaling,
    history: ScaleHistory,
    now_s: float,
    prefill: bool = False,
    last_request: float | None = None,
    wall_now: float = 0.0,
) -> Decision:
    """The next replica count for a resource (or pool) with `current` replicas; with
    minReplicas 0, `last_request` and `wall_now` (Unix times) decide about zero first."""
    if policy.min_replicas == 0:
        demand = from_demand(current, policy, history, last_request, wall_now)
        if demand is not None:
            return demand
    if not policy.min_replicas <= current <= policy.max_replicas:
        bounded = min(max(current, policy.min_replicas), policy.max_replicas)
        reason = "ScaledUp" if bounded > current else "ScaledDown"
        return Decision(bounded, reason, f"{current} replicas is outside {policy.min_replicas}..{policy.max_replicas}")
    if kv.reporting_replicas == 0:
        return Decision(current, "NoReports", "no replica reports its KV cache yet")
    wanted, why = recommend(current, kv, policy, prefill)
    up_window = policy.scale_up_stabilization_window_seconds
    down_window = policy.scale_down_stabilization_window_seconds
    history.remember(now_s, wanted, keep_s=max(up_window, down_window))
    if wanted > current:
        replicas = max(current, min(history.within(now_s, up_window)))
        if replicas > current:
            return Decision(replicas, "ScaledUp", why)
        return Decision(current, "ScaleUpStabilizing", f"{why}; waiting out the {up_window}s scale-up window")
    if wanted < current:
        if now_s - history.started_s < down_window:
            return Decision(current, "ScaleDownStabilizing", f"{why}; watched for less than {down_window}s")
        replicas = min(current, max(history.within(now_s, down_window)))
        if replicas < current:
            return Decision(replicas, "ScaledDown", why)
        return Decision(current, "ScaleDownStabilizing", f"{why}; a higher recommendation is within {down_window}s")
    return Decision(current, "Steady", why)
