"""The autoscaler's decisions on synthetic reports and clocks: up at once, down only after
the window, never outside min/max."""

from __future__ import annotations

from pagefleet.operator.autoscale import ScaleHistory, decide, recommend
from pagefleet.operator.replicas import KVSummary
from pagefleet.operator.spec import Autoscaling

POLICY = Autoscaling(enabled=True, min_replicas=1, max_replicas=5, target_kv_utilization=0.5)


def kv(replicas: int, utilization: float, waiting: int = 0) -> KVSummary:
    total = 100 * replicas
    return KVSummary(replicas, round(total * (1 - utilization)), total, utilization, waiting)


def test_the_recommendation_is_the_formula_bounded() -> None:
    assert recommend(2, kv(2, 0.9), POLICY) == (4, "mean KV utilization 90% against a target of 50%")
    assert recommend(2, kv(2, 0.52), POLICY)[0] == 2  # within the 10% tolerance
    assert recommend(2, kv(2, 0.2), POLICY)[0] == 1
    assert recommend(4, kv(4, 1.0), POLICY)[0] == 5  # 8 wanted, bounded by maxReplicas
    assert recommend(1, kv(1, 0.3, waiting=4), POLICY)[0] == 2  # a queue always asks for one more
    assert recommend(1, kv(1, 0.0), POLICY)[0] == 1  # never below minReplicas


def test_scale_up_is_immediate_with_no_up_window() -> None:
    history = ScaleHistory(started_s=0.0)
    decision = decide(2, kv(2, 0.95), POLICY, history, now_s=1.0)
    assert (decision.replicas, decision.reason) == (4, "ScaledUp")


def test_a_body_from_before_our_own_patch_is_read_as_the_patched_count() -> None:
    """kopf's watch can hand the next reconcile a body from before the scale patch: deciding
    from it would scale up (and count the event) a second time."""
    history = ScaleHistory(started_s=0.0)
    history.patched = (1, 2, 10.0)
    assert history.current(1, now_s=11.0) == 2  # the stale body
    assert history.current(2, now_s=12.0) == 2 and history.patched is None  # seen: forgotten
    history.patched = (1, 2, 10.0)
    assert history.current(3, now_s=11.0) == 3  # someone else changed it: theirs counts
    history.patched = (1, 2, 10.0)
    assert history.current(1, now_s=50.0) == 1  # long after the patch, the body is the truth


def test_scale_up_window_takes_the_lowest_recent_recommendation() -> None:
    policy = POLICY.model_copy(update={"scale_up_stabilization_window_seconds": 60})
    history = ScaleHistory(started_s=0.0)
    assert decide(2, kv(2, 0.5), policy, history, now_s=0.0).replicas == 2
    assert decide(2, kv(2, 0.95), policy, history, now_s=30.0).reason == "ScaleUpStabilizing"
    assert decide(2, kv(2, 0.95), policy, history, now_s=61.0).replicas == 4


def test_scale_down_waits_for_the_whole_window_of_low_pressure() -> None:
    history = ScaleHistory(started_s=0.0)
    window = POLICY.scale_down_stabilization_window_seconds
    for now in range(0, window, 10):
        decision = decide(4, kv(4, 0.1), POLICY, history, now_s=float(now))
        assert (decision.replicas, decision.reason) == (4, "ScaleDownStabilizing")
    decision = decide(4, kv(4, 0.1), POLICY, history, now_s=float(window))
    assert (decision.replicas, decision.reason) == (1, "ScaledDown")


def test_a_busy_moment_inside_the_window_holds_the_replicas() -> None:
    history = ScaleHistory(started_s=0.0)
    window = POLICY.scale_down_stabilization_window_seconds
    decide(4, kv(4, 0.5), POLICY, history, now_s=float(window))  # a steady recommendation of 4
    for now in range(window + 10, 2 * window, 10):
        assert decide(4, kv(4, 0.1), POLICY, history, now_s=float(now)).replicas == 4
    assert decide(4, kv(4, 0.1), POLICY, history, now_s=float(2 * window + 1)).replicas == 1


def test_out_of_bounds_replicas_come_back_at_once_and_no_reports_change_nothing() -> None:
    history = ScaleHistory(started_s=0.0)
    assert decide(9, kv(9, 0.5), POLICY, history, now_s=0.0).replicas == 5
    assert decide(0, kv(0, 0.0), POLICY, history, now_s=0.0).replicas == 1
    decision = decide(3, KVSummary.of([]), POLICY, history, now_s=0.0)
    assert (decision.replicas, decision.reason) == (3, "NoReports")


ZERO = Autoscaling(enabled=True, min_replicas=0, max_replicas=3, target_kv_utilization=0.5, idle_seconds=60)


def test_an_idle_model_scales_to_zero_and_a_request_brings_one_back() -> None:
    history = ScaleHistory(started_s=0.0, started_at=1000.0)
    busy = kv(1, 0.5)
    # Watched for less than idleSeconds with no request: the KV rules decide (never below one).
    assert decide(1, kv(1, 0.0), ZERO, history, 0.0, last_request=None, wall_now=1050.0).replicas == 1
    assert decide(1, busy, ZERO, history, 0.0, last_request=1030.0, wall_now=1080.0).replicas == 1
    gone = decide(1, busy, ZERO, history, 0.0, last_request=1030.0, wall_now=1091.0)
    assert (gone.replicas, gone.reason) == (0, "ScaledToZero")
    # At zero: nothing asked since it stopped keeps it there; a request brings one back.
    assert decide(0, kv(0, 0.0), ZERO, history, 0.0, last_request=1030.0, wall_now=1200.0).replicas == 0
    back = decide(0, kv(0, 0.0), ZERO, history, 0.0, last_request=1201.0, wall_now=1202.0)
    assert (back.replicas, back.reason) == (1, "ScaledUpFromZero")


def test_with_min_replicas_above_zero_the_demand_changes_nothing() -> None:
    history = ScaleHistory(started_s=0.0, started_at=0.0)
    decision = decide(1, kv(1, 0.5), POLICY, history, 0.0, last_request=None, wall_now=1e9)
    assert decision.replicas == 1
