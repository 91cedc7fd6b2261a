"""A short history of the fleet for the dashboard's charts, kept by the gateway itself so the
local fleet needs no Prometheus.

Every `interval` seconds the gateway takes one sample: each live replica's record from
Redis (KV usage, free blocks, running, waiting), each replica's own `/metrics` (tokens
generated, preemptions, time-to-first-token and inter-token histograms) and the gateway's
own counters (requests by status, errors, failovers, routing decisions). It keeps `span`
seconds of samples.

Charts turn the samples into series the way PromQL would: counters into `rate()` over
`window` seconds, histograms into `histogram_quantile()` of the window's increase, gauges
as they were.

Reading every replica's `/metrics` is the one costly part: at 128 simulated replicas it
took 2.5 s of the gateway's CPU every 20 s, more than routing. So on a fleet larger than
ALWAYS_SCRAPED replicas they are read only while the dashboard is watched (its data was
fetched within WATCHED_S), and their charts start when it is opened; the records and the
gateway's own counters are sampled always.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample as MetricSample

from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.registry import ReplicaRegistry

logger = logging.getLogger(__name__)

Kind = Literal["gauge", "rate", "quantiles"]
Key = tuple[str, str, str]  # (model, chart id, series name)
Buckets = dict[float, float]  # upper bound -> cumulative count


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    unit: str
    kind: Kind
    per: Literal["replica", "model"]


# The dashboard's charts, in page order; docs/observability.md and the Grafana dashboard (in the
# Helm chart) show the same figures.
CHARTS = (
    Chart("kv_usage", "KV cache usage", "%", "gauge", "replica"),
    Chart("free_blocks", "Free KV blocks", "blocks", "gauge", "replica"),
    Chart("output_tokens", "Output tokens/s", "tokens/s", "rate", "replica"),
    Chart("requests_in_engine", "Running and waiting requests", "requests", "gauge", "replica"),
    Chart("preemptions", "Preemptions/s", "1/s", "rate", "replica"),
    Chart("ttft", "Time to first token", "s", "quantiles", "model"),
    Chart("itl", "Inter-token latency", "s", "quantiles", "model"),
    Chart("requests", "Requests/s", "1/s", "rate", "model"),
    Chart("errors", "Errors/s by status", "1/s", "rate", "model"),
    Chart("failovers", "Failovers/s", "1/s", "rate", "model"),
    Chart("routing", "Routing decisions/s by replica", "1/s", "rate", "model"),
)
QUANTILES = (0.5, 0.99)
# What the charts read from a replica's /metrics: counter samples and histogram buckets, by
# the chart they feed. Only these lines are parsed (a quarter of the page), on the gateway's loop.
REPLICA_COUNTERS = {
    "pagefleet:generation_tokens_total": "output_tokens",
    "pagefleet:num_preemptions_total": "preemptions",
}
REPLICA_BUCKETS = {
    "pagefleet:time_to_first_token_seconds_bucket": "ttft",
    "pagefleet:inter_token_latency_seconds_bucket": "itl",
}
_CHARTED_PREFIXES = tuple(REPLICA_COUNTERS) + tuple(REPLICA_BUCKETS)
ALWAYS_SCRAPED = 16  # replicas; 16 scrapes every 2 s cost about 1% of a core
WATCHED_S = 120.0


@dataclass
class Snapshot:
    time: float
    values: dict[Key, float] = field(default_factory=dict)  # gauges and counters
    histograms: dict[Key, Buckets] = field(default_factory=dict)

    def add(self, key: Key, value: float) -> None:
        self.values[key] = self.values.get(key, 0.0) + value

    def add_buckets(self, key: Key, bound: float, count: float) -> None:
        buckets = self.histograms.setdefault(key, {})
        buckets[bound] = buckets.get(bound, 0.0) + count


class FleetHistory:
    def __init__(
        self,
        registry: ReplicaRegistry,
        gateway_metrics: GatewayMetrics,
        interval: float = 2.0,
        span: float = 300.0,
        window: float = 10.0,
    ) -> None:
        self.registry = registry
        # Only the counters the charts read: collecting the whole registry (with its
        # per-replica latency histogram) was the sampler's largest cost at 128 replicas.
        self._charted_counters = (
            gateway_metrics.requests,
            gateway_metrics.errors,
            gateway_metrics.failovers,
            gateway_metrics.routing_decisions,
        )
        self.interval, self.span, self.window = interval, span, window
        self.snapshots: deque[Snapshot] = deque(maxlen=max(2, int(span / interval) + 1))
        self._client = httpx.AsyncClient(timeout=max(0.5, interval / 2))
        self._last_scraped: dict[str, list[MetricSample]] = {}  # replica url -> its last good scrape
        self._watched_until = 0.0  # monotonic time until which replicas are scraped on a large fleet

    def watched(self) -> None:
        """The dashboard was read: scrape the replicas for the next WATCHED_S."""
        self._watched_until = time.monotonic() + WATCHED_S

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            try:
                self.snapshots.append(await self.sample())
            except Exception:  # a bad sample must not end the history
                logger.exception("dashboard sample failed")
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        await self._client.aclose()

    async def sample(self) -> Snapshot:
        snapshot = Snapshot(time.time())
        records = [(model, r) for model, replicas in self.registry.by_model.items() for r in replicas]
        if len(records) <= ALWAYS_SCRAPED or time.monotonic() < self._watched_until:
            scraped = await asyncio.gather(*(self._scrape(record.url) for _, record in records))
        else:
            scraped = [[] for _ in records]
        live = {record.url for _, record in records}
        self._last_scraped = {url: samples for url, samples in self._last_scraped.items() if url in live}
        for (model, record), samples in zip(records, scraped, strict=True):
            replica = record.replica_id
            snapshot.add((model, "kv_usage", replica), 100.0 * record.kv_usage)
            snapshot.add((model, "free_blocks", replica), record.free_blocks)
            snapshot.add((model, "requests_in_engine", f"{replica} running"), record.running)
            snapshot.add((model, "requests_in_engine", f"{replica} waiting"), record.waiting)
            for sample in samples:
                _add_replica_sample(snapshot, model, replica, sample)
        for counter in self._charted_counters:
            for family in counter.collect():
                for sample in family.samples:
                    _add_gateway_sample(snapshot, sample)
        return snapshot

    async def _scrape(self, url: str) -> list[MetricSample]:
        """The replica's samples; if it does not answer, its last ones (its rates read 0 for
        the moment rather than jumping when it answers again)."""
        try:
            response = await self._client.get(f"{url.rstrip('/')}/metrics")
            response.raise_for_status()
        except httpx.HTTPError:
            return self._last_scraped.get(url, [])
        charted = "\n".join(line for line in response.text.splitlines() if line.startswith(_CHARTED_PREFIXES))
        samples = [sample for family in text_string_to_metric_families(charted) for sample in family.samples]
        self._last_scraped[url] = samples
        return samples

    def charts(self, model: str) -> list[dict[str, Any]]:
        """The model's charts over the kept span: `{id, title, unit, series: [{name, points}]}`,
        each point `[unix time, value or null]`."""
        self.watched()
        snapshots = list(self.snapshots)
        replicas_model = self.registry.parent(model) or model  # an adapter's replicas chart under their base model
        return [
            {
                "id": chart.id,
                "title": chart.title,
                "unit": chart.unit,
                "series": [
                    {"name": name, "points": points}
                    for name, points in sorted(
                        self._series(chart, replicas_model if chart.per == "replica" else model, snapshots).items()
                    )
                ],
            }
            for chart in CHARTS
        ]

    def _series(self, chart: Chart, model: str, snapshots: list[Snapshot]) -> dict[str, list[list[float | None]]]:
        series: dict[str, list[list[float | None]]] = {}
        for index, now in enumerate(snapshots):
            before = self._window_start(snapshots, index)
            figures: dict[str, float | None]
            if chart.kind == "gauge":
                figures = {key[2]: value for key, value in now.values.items() if key[:2] == (model, chart.id)}
            elif before is None:
                continue
            elif chart.kind == "rate":
                # A replica's counter needs two samples (it may have run long before it
                # appeared here); a gateway counter missing before was 0 (made at its first use).
                figures = _rates(now, before, model, chart.id, missing_is_zero=chart.per == "model")
            else:
                figures = _quantiles(now, before, model, chart.id)
            for name, value in figures.items():
                series.setdefault(name, []).append([round(now.time, 3), _round(value)])
        return series

    def _window_start(self, snapshots: list[Snapshot], index: int) -> Snapshot | None:
        """The oldest earlier sample within the window (or the one just before, when samples
        are further apart than the window)."""
        start = None
        for candidate in range(index - 1, -1, -1):
            if snapshots[index].time - snapshots[candidate].time > self.window + 1e-6:
                return start or snapshots[candidate]
            start = snapshots[candidate]
        return start


def _add_replica_sample(snapshot: Snapshot, model: str, replica: str, sample: MetricSample) -> None:
    if sample.name in REPLICA_COUNTERS:
        snapshot.add((model, REPLICA_COUNTERS[sample.name], replica), sample.value)
    elif sample.name in REPLICA_BUCKETS:
        snapshot.add_buckets((model, REPLICA_BUCKETS[sample.name], ""), float(sample.labels["le"]), sample.value)


def _add_gateway_sample(snapshot: Snapshot, sample: MetricSample) -> None:
    labels = sample.labels
    if sample.name == "pagefleet_gateway:requests_total":
        snapshot.add((labels["model"], "requests", "requests"), sample.value)
        if int(labels["status"]) >= 400:
            snapshot.add((labels["model"], "errors", labels["status"]), sample.value)
    elif sample.name == "pagefleet_gateway:errors_total" and labels["model"]:
        snapshot.add((labels["model"], "errors", labels["status"]), sample.value)
    elif sample.name == "pagefleet_gateway:failovers_total":
        snapshot.add((labels["model"], "failovers", labels["replica"]), sample.value)
    elif sample.name == "pagefleet_gateway:routing_decisions_total":
        snapshot.add((labels["model"], "routing", labels["replica"]), sample.value)


def _rates(now: Snapshot, before: Snapshot, model: str, chart: str, missing_is_zero: bool) -> dict[str, float | None]:
    elapsed = now.time - before.time
    rates: dict[str, float | None] = {}
    for key, value in now.values.items():
        if key[:2] == (model, chart):
            previous = before.values.get(key, 0.0 if missing_is_zero else None)
            if previous is None:
                continue
            increase = value - previous if value >= previous else value  # a restart resets counters
            rates[key[2]] = increase / elapsed
    return rates


def _quantiles(now: Snapshot, before: Snapshot, model: str, chart: str) -> dict[str, float | None]:
    buckets, earlier = now.histograms.get((model, chart, "")), before.histograms.get((model, chart, ""))
    if buckets is None or earlier is None:  # the replicas were not read in both samples
        return {}
    increase = {bound: count - earlier.get(bound, 0.0) for bound, count in buckets.items()}
    if any(count < 0 for count in increase.values()):  # a replica restarted: take what it has now
        increase = buckets
    return {f"p{round(q * 100)}": histogram_quantile(q, increase) for q in QUANTILES}


def histogram_quantile(quantile: float, buckets: Buckets) -> float | None:
    """Prometheus' `histogram_quantile`: linear within the bucket the rank falls in; the
    highest finite bound if it falls in +Inf; None with no observations."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = quantile * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return lower


def _round(value: float | None) -> float | None:
    return None if value is None else float(f"{value:.4g}")
