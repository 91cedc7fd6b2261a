"""Prometheus metrics, named `pagefleet:*` after vLLM's `vllm:*` so dashboards map over.

Engine figures (requests, blocks, prefix cache, preemptions, copies, token counts) are read
from `EngineStats` at scrape time; latencies are histograms observed by the handlers. vLLM's
own metrics are served beside them, under its names, labels and buckets (vllm_metrics.py),
so vLLM's dashboards, alerts and the routers that scrape vLLM read pagefleet unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagefleet.engine.front.stats import EngineStats, TierStats
from pagefleet.engine.server.vllm_metrics import VLLMRequestMetrics, engine_families, spec_decode_families

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineCollector(Collector):
    """Gauges and counters straight from the engine's stats, labelled by model."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.read_stats = read_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.read_stats()
        if stats is None:  # still loading
            return
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"pagefleet:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"pagefleet:{name}", doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield from engine_families(self.model_name, stats)
        yield gauge("num_requests_running", "Requests being computed.", stats.num_running_requests)
        yield gauge("num_requests_waiting", "Requests queued or preempted.", stats.num_waiting_requests)
        yield gauge("num_requests_swapped", "Requests preempted to host memory.", stats.num_swapped_requests)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", stats.kv_usage)
        yield gauge("num_free_blocks", "KV blocks free now.", stats.num_free_blocks)
        yield gauge("num_total_blocks", "KV blocks in the cache.", stats.num_total_blocks)
        yield gauge("num_cached_blocks", "KV blocks holding a reusable prefix.", stats.num_cached_blocks)
        if stats.num_state_slots:  # a model with state layers
            yield gauge("num_state_slots", "State-cache slots (one per running sequence).", stats.num_state_slots)
            yield gauge("num_free_state_slots", "State-cache slots free now.", stats.num_free_state_slots)
            yield gauge("num_state_snapshots", "State snapshots kept for prefix caching.", stats.num_state_snapshots)
        yield gauge("num_shared_blocks", "KV blocks referenced by several sequences.", stats.num_shared_blocks)
        yield gauge(
            "num_blocks_saved_by_sharing", "Block copies that sharing avoids now.", stats.num_blocks_saved_by_sharing
        )
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
        )
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", stats.prefix_cache_hits)
        preemptions = CounterMetricFamily(
            "pagefleet:num_preemptions", "Requests preempted, by mode.", labels=["model_name", "mode"]
        )
        preemptions.add_metric([self.model_name, "recompute"], stats.num_preemptions_recompute)
        preemptions.add_metric([self.model_name, "swap"], stats.num_preemptions_swap)
        yield preemptions
        yield counter("cow_copies", "Copy-on-write block copies.", stats.num_cow_copies)
        yield gauge(
            "num_waiting_prompt_tokens",
            "Prompt tokens of queued requests (prefill pressure).",
            stats.num_waiting_prompt_tokens,
        )
        yield gauge("kv_pinned_blocks", "KV blocks of prefilled prompts waiting to be pulled.", stats.num_pinned_blocks)
        yield gauge("kv_pinned_requests", "Prefilled prompts waiting to be pulled.", stats.num_pinned_requests)
        yield counter("kv_pin_timeouts", "Prefilled prompts freed because nobody pulled them.", stats.num_pin_timeouts)
        if stats.kv_tier is not None:
            yield from _tier_families(counter, stats.kv_tier)
        if stats.spec_decode is not None:
            yield from spec_decode_families("pagefleet", ["model_name"], label, stats.spec_decode)
        yield counter("prompt_tokens", "Prompt tokens received.", stats.num_prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.num_generation_tokens)


class ServerMetrics:
    """One registry per server (so tests can run several in a process)."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(model_name, read_stats))

        def histogram(name: str, doc: str) -> Any:
            return Histogram(
                f"pagefleet:{name}", doc, ["model_name"], registry=self.registry, buckets=_LATENCY_BUCKETS
            ).labels(model_name)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time from request to its first token.")
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between a request's tokens.")
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Time from request to its last token.")
        # Prefill/decode disaggregation, by direction: "sent" (prefill side), "received" (decode
        # side); peer pulls of cached prefixes: "peer_sent", "peer_received" (kv_peers.py).
        labels = ["model_name", "direction"]
        self._kv_blocks = Counter(
            "pagefleet:kv_transfer_blocks", "KV blocks moved between replicas.", labels, registry=self.registry
        )
        self._kv_bytes = Counter(
            "pagefleet:kv_transfer_bytes", "KV bytes moved between replicas.", labels, registry=self.registry
        )
        self._kv_seconds = Histogram(
            "pagefleet:kv_transfer_seconds",
            "Time one KV transfer took.",
            labels,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.kv_transfer_failures = Counter(
            "pagefleet:kv_transfer_failures",
            "KV pulls that failed or were refused.",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)
        self._kv_peer_pulls = Counter(
            "pagefleet:kv_peer_pulls",
            "Prefixes asked of a peer, by outcome: hit, miss (it had no more), failed, refused (the "
            "cost model), not_needed (this replica had as much).",
            ["model_name", "outcome"],
            registry=self.registry,
        )
        self._model_name = model_name
        self.vllm: VLLMRequestMetrics | None = None  # once the engine is loaded

    def engine_loaded(self, max_model_len: int, cache_config: dict[str, str]) -> None:
        """vLLM's request histograms, whose token buckets go up to the context window, and
        its cache_config_info."""
        self.vllm = VLLMRequestMetrics(self.registry, self._model_name, max_model_len, cache_config)

    def observe_token_gap(self, first: bool, seconds: float) -> None:
        """A request's first token after `seconds`, or a later one `seconds` after the last."""
        (self.time_to_first_token if first else self.inter_token_latency).observe(seconds)
        if self.vllm is not None:
            (self.vllm.time_to_first_token if first else self.vllm.inter_token_latency).observe(seconds)

    def kv_peer_pull(self, outcome: str) -> None:
        self._kv_peer_pulls.labels(self._model_name, outcome).inc()

    def kv_transferred(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        self._kv_blocks.labels(self._model_name, direction).inc(blocks)
        self._kv_bytes.labels(self._model_name, direction).inc(nbytes)
        self._kv_seconds.labels(self._model_name, direction).observe(seconds)


def _tier_families(counter: Callable[[str, str, float], CounterMetricFamily], tier: TierStats) -> Iterator[Metric]:
    """The file tier's counters (docs/kv-tiers.md)."""
    yield counter("kv_tier_lookups", "Prompts looked up in the KV file tier.", tier.lookups)
    yield counter("kv_tier_hits", "Prompts whose prefix was read from the KV file tier.", tier.hits)
    yield counter(
        "kv_tier_hit_tokens", "Prompt tokens read from the KV file tier instead of computed.", tier.hit_tokens
    )
    yield counter("kv_tier_read_bytes", "Bytes read from the KV file tier.", tier.read_bytes)
    yield counter("kv_tier_written_blocks", "Blocks written to the KV file tier.", tier.written_blocks)
    yield counter("kv_tier_written_bytes", "Bytes written to the KV file tier.", tier.written_bytes)
    yield counter("kv_tier_skipped_blocks", "Blocks not written because the writer was behind.", tier.skipped_blocks)
    yield counter("kv_tier_refused", "Reads the cost model turned down (recomputing was faster).", tier.refused)
    yield counter("kv_tier_bad_files", "Files found unusable (another layout, torn, corrupted).", tier.bad_files)
    yield counter(
        "kv_tier_seconds_saved", "Estimated prefill time saved, net of the measured read time.", tier.seconds_saved
    )
