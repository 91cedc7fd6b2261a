"""vLLM's own metrics (`vllm:*`), under its names, labels and buckets, next to `pagefleet:*`.

vLLM's Grafana dashboards, alerts and autoscaling rules (KEDA, the Gateway API Inference
Extension's endpoint picker, vLLM's router) read these names, so a pagefleet replica is
read by them unchanged. Labels are vLLM's: `model_name` and `engine` (always "0": one
engine per server). Engine-wide figures come from `EngineStats` at scrape time
(`engine_families`); per-request and per-step figures are observed as requests finish and
steps end (`VLLMRequestMetrics`).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.front.stats import EngineStats, SpecDecodeStats
from pagefleet.engine.sample.sampling_params import SamplingParams

LABELS = ["model_name", "engine"]
ENGINE = "0"
FINISHED_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_GAP_BUCKETS += (5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_TIME_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0)
REQUEST_TIME_BUCKETS += (50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets for token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def engine_families(model_name: str, stats: EngineStats) -> Iterator[Metric]:
    """The engine-wide gauges and counters, from the latest stats."""
    label = [model_name, ENGINE]
    gauges = (
        ("num_requests_running", "Number of requests in model execution batches.", stats.num_running_requests),
        ("num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting_requests),
        ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage),
    )
    yield from _families(GaugeMetricFamily, "vllm", LABELS, label, gauges)
    # Every waiting request here waits for capacity (KV blocks, the token budget, sequence
    # slots); none is deferred for something else (vLLM's: a KV load, a grammar compiling):
    # those happen before a request joins the queue.
    by_reason = GaugeMetricFamily(
        "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.", labels=[*LABELS, "reason"]
    )
    by_reason.add_metric([*label, "capacity"], stats.num_waiting_requests)
    by_reason.add_metric([*label, "deferred"], 0)
    yield by_reason
    preemptions = stats.num_preemptions_recompute + stats.num_preemptions_swap
    counters = (
        ("prompt_tokens", "Number of prefill tokens processed.", stats.num_prompt_tokens),
        ("generation_tokens", "Number of generation tokens processed.", stats.num_generation_tokens),
        ("num_preemptions", "Cumulative number of preemption from the engine.", preemptions),
        (
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.prefix_cache_queries,
        ),
        ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", stats.prefix_cache_hits),
        (
            "external_prefix_cache_queries",
            "External prefix cache queries (the KV file tier), in terms of number of queried tokens.",
            stats.kv_tier.lookup_tokens if stats.kv_tier is not None else 0,
        ),
        (
            "external_prefix_cache_hits",
            "External prefix cache hits (the KV file tier), in terms of number of cached tokens.",
            stats.kv_tier.hit_tokens if stats.kv_tier is not None else 0,
        ),
    )
    yield from _families(CounterMetricFamily, "vllm", LABELS, label, counters)
    if stats.spec_decode is not None:
        yield from spec_decode_families("vllm", LABELS, label, stats.spec_decode)


def spec_decode_families(prefix: str, labels: list[str], values: list[str], spec: SpecDecodeStats) -> Iterator[Metric]:
    """Speculative decoding's counters under vLLM's names (`prefix` "vllm" or "pagefleet")."""
    totals = (
        ("spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts),
        ("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
    )
    yield from _families(CounterMetricFamily, prefix, labels, values, totals)
    per_position = CounterMetricFamily(
        f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
        "Accepted tokens per draft position.",
        labels=[*labels, "position"],
    )
    for position, accepted in enumerate(spec.accepted_per_position):
        per_position.add_metric([*values, str(position)], accepted)
    yield per_position


def _families(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    prefix: str,
    labels: list[str],
    values: list[str],
    rows: tuple[tuple[str, str, float], ...],
) -> Iterator[Metric]:
    """One family of `kind` per (name, doc, value) row, each with one sample."""
    for name, doc, value in rows:
        family = kind(f"{prefix}:{name}", doc, labels=labels)
        family.add_metric(values, value)
        yield family


class VLLMRequestMetrics:
    """vLLM's per-request and per-step histograms and its finished-request counter."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, max_model_len: int, cache_config: dict[str, str]
    ) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> Histogram:
            return Histogram(f"vllm:{name}", doc, LABELS, registry=registry, buckets=buckets).labels(model_name, ENGINE)

        tokens = one_two_five(max_model_len)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_GAP_BUCKETS
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_TIME_BUCKETS
        )
        # vLLM's request phases: queued, then running (its prefill, then its decode).
        self.phase_seconds = {
            phase: histogram(
                f"request_{phase}_time_seconds",
                f"Histogram of time spent in {state} phase for request.",
                REQUEST_TIME_BUCKETS,
            )
            for phase, state in (
                ("queue", "WAITING"),
                ("inference", "RUNNING"),
                ("prefill", "PREFILL"),
                ("decode", "DECODE"),
            )
        }
        self.prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Number of generation tokens processed.", tokens
        )
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS
        )
        # vLLM's: a gauge of 1 whose labels are the KV cache's settings (and the engine).
        cache_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*cache_config, "engine"],
            registry=registry,
        )  # fmt: skip
        cache_info.labels(*cache_config.values(), ENGINE).set(1)
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=registry,
        )
        self._success = {reason: success.labels(model_name, ENGINE, reason) for reason in FINISHED_REASONS}

    def finished(self, output: RequestOutput, params: SamplingParams, e2e_s: float, finished_at: float) -> None:
        """A request the engine finished (`finished_at`: time.monotonic(), as its events)."""
        reason = next((c.finish_reason for c in output.outputs if c.finish_reason), None) or "abort"
        self._success.get(reason, self._success["error"]).inc()
        self.e2e.observe(e2e_s)
        self.prompt_tokens.observe(output.usage.prompt_tokens)
        self.generation_tokens.observe(output.usage.completion_tokens)
        self.params_n.observe(params.n)
        if params.max_tokens is not None:
            self.params_max_tokens.observe(params.max_tokens)
        arrived = output.metrics.get("arrival_time")
        scheduled = next((event.time for event in output.events if event.name == "scheduled"), None)
        first_token = output.metrics.get("first_token_time")
        if arrived is None or scheduled is None or first_token is None:
            return  # refused or aborted before it ran
        for phase, seconds in (
            ("queue", scheduled - arrived),
            ("inference", finished_at - scheduled),
            ("prefill", first_token - scheduled),
            ("decode", finished_at - first_token),
        ):
            self.phase_seconds[phase].observe(max(0.0, seconds))
        later_tokens = max(len(c.token_ids) for c in output.outputs) - 1 if output.outputs else 0
        if later_tokens > 0:
            self.time_per_output_token.observe((finished_at - first_token) / later_tokens)
