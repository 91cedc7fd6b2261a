"""The gateway's decisions without a gateway process: routing policies on replica records,
request shaping, and the rate limiter on a real Redis."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf.struct_pb2 import Struct

from pagefleet.gateway.admission import Admission
from pagefleet.gateway.core import RoutingCore
from pagefleet.gateway.errors import Refusal
from pagefleet.gateway.limits import RateLimiter
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.picker import DESTINATION, LB_NAMESPACE, SUBSET, SUBSET_NAMESPACE, EndpointPicker, endpoint
from pagefleet.gateway.proxy import OutlierDetector
from pagefleet.gateway.registry import ReplicaRegistry
from pagefleet.gateway.reservations import Reservations, promise_keys
from pagefleet.gateway.routing import LeastRequestsPolicy, PrefixPolicy, RoundRobinPolicy, RoutedRequest
from pagefleet.gateway.settings import PickerSettings
from pagefleet.gateway.shape import RequestShape, describe
from pagefleet.gateway.upstream import UpstreamError, UpstreamPool
from pagefleet.protocol.demand import DemandSignal, demand_key, read_demand, scalable_key
from pagefleet.protocol.replica import ReplicaRecord, record_key
from tests.processes import RedisProcess


def _replica(
    name: str, free: int = 100, running: int = 0, waiting: int = 0, reported: float | None = None, port: int = 8000
) -> ReplicaRecord:
    """A replica record of model `m` at 10.0.0.<n>:<port>, reported at `reported` (now)."""
    return ReplicaRecord(
        replica_id=name,
        model="m",
        url=f"http://10.0.0.{sum(map(ord, name)) % 250}:{port}",
        free_blocks=free,
        total_blocks=1000,
        block_size=16,
        running=running,
        waiting=waiting,
        max_model_len=2048,
        timestamp=time.time() if reported is None else reported,
    )


def _choose(policy, candidates: list[ReplicaRecord], prefix: str = "", model: str = "m") -> str | None:  # type: ignore[no-untyped-def]
    shape = RequestShape(model, prompt_tokens=1, max_tokens=1, num_sequences=1, prefix=prefix)
    route = asyncio.run(policy.choose(candidates, RoutedRequest(shape, 1)))
    return None if route is None else route.replica.replica_id


def test_round_robin_takes_turns_per_model_in_a_stable_order() -> None:
    policy = RoundRobinPolicy()
    replicas = [_replica("b"), _replica("a"), _replica("c")]
    assert [_choose(policy, replicas) for _ in range(4)] == ["a", "b", "c", "a"]
    assert _choose(policy, replicas, model="other") == "a", "each model has its own turn"
    assert _choose(policy, []) is None


def test_least_requests_counts_running_and_waiting_then_prefers_free_blocks() -> None:
    policy = LeastRequestsPolicy()
    busy, idle = _replica("busy", running=3, waiting=2), _replica("idle", running=1)
    assert _choose(policy, [busy, idle]) == "idle"
    tie_small, tie_large = _replica("small", free=10, running=1), _replica("large", free=90, running=1)
    assert _choose(policy, [tie_small, tie_large]) == "large"


def test_prefix_keeps_a_prompt_on_one_replica_unless_it_is_much_fuller() -> None:
    policy = PrefixPolicy(min_free_ratio=0.5)
    replicas = [_replica(name) for name in "abcd"]
    prompts = [f"system prompt {i}: " for i in range(20)]
    first = [_choose(policy, replicas, prefix) for prefix in prompts]
    assert [_choose(policy, list(reversed(replicas)), prefix) for prefix in prompts] == first, "order does not matter"
    assert len(set(first)) > 1, "different prompts spread over the replicas"
    chosen = first[0]
    crowded = [_replica(r.replica_id, free=10 if r.replica_id == chosen else 100) for r in replicas]
    assert _choose(policy, crowded, prompts[0]) != chosen, "below half the emptiest's free blocks: go elsewhere"


def test_request_shaping_estimates_what_routing_and_limits_need() -> None:
    shape = describe(json.dumps({"model": "m", "prompt": "x" * 400, "max_tokens": 50, "n": 2}).encode(), chat=False)
    assert (shape.model, shape.max_tokens, shape.num_sequences) == ("m", 50, 2)
    assert shape.prompt_tokens == 100 and shape.tokens == 100 + 2 * 50  # ~4 characters a token
    assert shape.blocks(16) == 7 + 2 * 4
    ids = describe(json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}).encode(), chat=False)
    assert ids.prompt_tokens == 3 and ids.prefix == "1,2,3"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_completion_tokens": 9}
    assert describe(json.dumps(chat).encode(), chat=True).max_tokens == 9
    for body, param in (
        (b"{", None),
        (b"[]", None),
        (b'{"model": 5, "prompt": "x"}', "model"),
        (b'{"model": "m", "n": "2"}', "max_tokens"),
    ):
        with pytest.raises(Refusal) as refused:
            describe(body, chat=False)
        assert (refused.value.status, refused.value.param) == (400, param)


def test_rate_limiter_counts_requests_and_tokens_per_key_per_minute(redis_server: RedisProcess) -> None:
    async def scenario() -> list[tuple[bool, str]]:
        client = aioredis.from_url(redis_server.url)
        limiter = RateLimiter(client, requests_per_minute=2, tokens_per_minute=100)
        verdicts = [
            await limiter.check("key-a", 10),
            await limiter.check("key-a", 10),
            await limiter.check("key-a", 10),  # a third request in the minute
            await limiter.check("key-b", 150),  # another key, too many tokens at once
            await limiter.check("key-c", 10),  # its own budget
        ]
        await client.aclose()
        return [(v.allowed, v.reason) for v in verdicts]

    verdicts = asyncio.run(scenario())
    assert [allowed for allowed, _ in verdicts] == [True, True, False, False, True]
    assert "2 requests per minute" in verdicts[2][1] and "100 tokens per minute" in verdicts[3][1]


def test_rate_limiter_fails_open_when_redis_is_gone() -> None:
    async def scenario() -> bool:
        client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        verdict = await RateLimiter(client, 1, 0).check("key", 1)
        await client.aclose()
        return verdict.allowed

    assert asyncio.run(scenario()), "Redis trouble must not stop traffic"


def test_reservations_choose_net_of_promises_and_keep_their_sum(redis_server: RedisProcess) -> None:
    """Promises count against a replica until its next report, are released once, and the
    running sum always equals the promises outstanding."""

    async def scenario() -> None:
        client = aioredis.from_url(redis_server.url)
        await client.flushdb()
        reservations = Reservations(client)
        before = time.time() - 5  # both replicas reported before any promise
        a, b = _replica("a", 100, reported=before), _replica("b", 90, reported=before)
        chosen = [await reservations.reserve([a, b], 30) for _ in range(3)]
        # a: 100 -> 70; b: 90 -> 60; a: 70 -> 40.
        assert [p.replica.replica_id for p in chosen] == ["a", "b", "a"]
        promises, total = promise_keys(a)
        assert await client.zcard(promises) == 2 and int(await client.get(total)) == 60
        await reservations.release(chosen[0])
        await reservations.release(chosen[0])  # twice: taken off once
        assert int(await client.get(total)) == 30
        # a reports after the promises were made: they are in its figures now, and dropped.
        reported_a = _replica("a", 70, reported=time.time() + 1)
        assert (await reservations.reserve([reported_a, b], 1)).replica.replica_id == "a"  # 70 vs 90 - 30
        assert await client.zcard(promises) == 1 and int(await client.get(total)) == 1
        await client.aclose()

    asyncio.run(scenario())


class _Upstream:
    """A real HTTP/1.1 server on loopback: answers JSON with a length, or a chunked stream,
    and counts its connections."""

    def __init__(self) -> None:
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
            if not head:
                break
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.startswith(b"content-length"))
            )
            body = await reader.readexactly(length)
            if body == b"stream":
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                for piece in (b"data: 1\n\n", b"data: 2\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
            elif body == b"close":
                writer.close()
                return
            else:
                answer = b'{"echo": "' + body + b'"}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
            await writer.drain()
        writer.close()


def test_upstream_pool_reuses_connections_and_reads_both_kinds_of_body() -> None:
    async def scenario() -> None:
        upstream = _Upstream()
        server = await asyncio.start_server(upstream.handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        pool = UpstreamPool(connect_timeout=1, read_timeout=5, max_idle_s=0.3)
        for text in (b"one", b"two"):
            response = await pool.post(url, "/v1/completions", text, b"x-request-id: r\r\n")
            assert response.status == 200 and await response.read() == b'{"echo": "' + text + b'"}'
            response.release()
        assert upstream.connections == 1, "the second request reuses the first's connection"
        streamed = await pool.post(url, "/v1/completions", b"stream", b"")
        assert streamed.header(b"content-type") == b"text/event-stream"
        assert [chunk async for chunk in streamed.chunks()] == [b"data: 1\n\n", b"data: 2\n\n"]
        streamed.release()
        await asyncio.sleep(0.4)  # idle longer than max_idle_s: not reused
        (await pool.post(url, "/", b"three", b"")).close()
        assert upstream.connections == 2
        with pytest.raises(UpstreamError):
            await pool.post(url, "/", b"close", b"")  # the replica hangs up without answering
        pool.close()
        server.close()
        with pytest.raises(UpstreamError):
            await pool.post("http://127.0.0.1:1", "/", b"x", b"")

    asyncio.run(scenario())


def test_a_model_without_replicas_is_known_for_a_while_then_forgotten(redis_server: RedisProcess) -> None:
    async def scenario() -> None:
        client = aioredis.from_url(redis_server.url)
        await client.flushdb()
        registry = ReplicaRegistry(client, refresh_interval=0.1, ttl=60, grace=30, forget_after=0.3)
        record = _replica("a", 10, reported=time.time())
        await client.set(record_key("m", "a"), record.model_dump_json())
        await registry.refresh()
        assert registry.is_known("m") and registry.candidates("m")
        await client.delete(record_key("m", "a"))
        await registry.refresh()
        assert registry.is_known("m") and not registry.candidates("m"), "503 for a while, not 404"
        await asyncio.sleep(0.35)
        await registry.refresh()
        assert not registry.is_known("m") and not registry.is_known("never-served")
        await client.aclose()

    asyncio.run(scenario())


def test_admission_refuses_with_the_right_status_and_counts_each_refusal(redis_server: RedisProcess) -> None:
    async def scenario() -> list[int]:
        client = aioredis.from_url(redis_server.url)
        await client.flushdb()
        await client.set(record_key("m", "a"), _replica("a", 10, reported=time.time()).model_dump_json())
        registry = ReplicaRegistry(client, 0.1, 60, 30)
        metrics = GatewayMetrics()
        admission = Admission(
            {"good-key"}, registry, RateLimiter(client, 1, 0), metrics, DemandSignal(client), 300, 256
        )
        body = json.dumps({"model": "m", "prompt": "hi"}).encode()
        statuses = []
        for authorization, payload in [
            ("", body),  # no key
            ("Bearer good-key", body),  # not refreshed yet: no view of the replicas
        ]:
            with pytest.raises(Refusal) as refused:
                await admission.admit(authorization, payload, chat=False)
            statuses.append(refused.value.status)
        await registry.refresh()
        for authorization, payload in [
            ("Bearer good-key", b"{"),
            ("Bearer good-key", json.dumps({"model": "other", "prompt": "hi"}).encode()),
        ]:
            with pytest.raises(Refusal) as refused:
                await admission.admit(authorization, payload, chat=False)
            statuses.append(refused.value.status)
        assert (await admission.admit("Bearer good-key", body, chat=False)).model == "m"
        with pytest.raises(Refusal) as refused:
            await admission.admit("Bearer good-key", body, chat=False)  # one request a minute
        statuses.append(refused.value.status)
        assert refused.value.headers["Retry-After"].isdigit()
        counted = {
            (s.labels["model"], s.labels["reason"]): s.value
            for family in metrics.registry.collect()
            for s in family.samples
            if s.name == "pagefleet_gateway:errors_total"
        }
        assert counted == {
            ("", "unauthorized"): 1,
            ("", "registry_unavailable"): 1,
            ("", "bad_request"): 1,
            ("", "unknown_model"): 1,
            ("m", "rate_limited"): 1,
        }
        await client.aclose()
        return statuses

    assert asyncio.run(scenario()) == [401, 503, 400, 404, 429]


def test_a_request_without_model_means_the_fleets_one_model(redis_server: RedisProcess) -> None:
    """`model` is optional, as on vLLM's server: absent or null is the fleet's base model when
    it serves one; with several, a 400 naming the field."""

    async def scenario() -> None:
        client = aioredis.from_url(redis_server.url)
        await client.flushdb()
        await client.set(record_key("m", "a"), _replica("a", 10, reported=time.time()).model_dump_json())
        registry = ReplicaRegistry(client, 0.1, 60, 30)
        await registry.refresh()
        admission = Admission(
            set(), registry, RateLimiter(client, 0, 0), GatewayMetrics(), DemandSignal(client), 300, 256
        )
        for body in ({"prompt": "hi"}, {"model": None, "prompt": "hi"}):
            assert (await admission.admit("", json.dumps(body).encode(), chat=False)).model == "m"
        other = _replica("b", 10, reported=time.time()).model_copy(update={"model": "n"})
        await client.set(record_key("n", "b"), other.model_dump_json())
        await registry.refresh()
        with pytest.raises(Refusal) as refused:
            await admission.admit("", json.dumps({"prompt": "hi"}).encode(), chat=False)
        assert refused.value.status == 400 and refused.value.param == "model"
        await client.aclose()

    asyncio.run(scenario())


def _exchange(body: dict[str, object], subset: list[str] | None = None) -> list[ext_proc.ProcessingRequest]:
    """What Envoy sends in BUFFERED mode for one POST /v1/completions."""
    headers = ext_proc.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=":path", raw_value=b"/v1/completions")]), end_of_stream=False
    )
    request_body = ext_proc.ProcessingRequest(
        request_body=ext_proc.HttpBody(body=json.dumps(body).encode(), end_of_stream=True)
    )
    if subset is not None:
        hint = Struct()
        hint.update({SUBSET: subset})
        request_body.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    return [ext_proc.ProcessingRequest(request_headers=headers), request_body]


def test_the_picker_honours_the_subset_hint_and_lists_fallbacks(redis_server: RedisProcess) -> None:
    """Envoy's `envoy.lb.subset_hint` limits the choice; fallbacks follow the chosen replica
    in the header and in the `envoy.lb` metadata, with one value for both."""

    async def pick(picker: EndpointPicker, messages: list[ext_proc.ProcessingRequest]) -> ext_proc.ProcessingResponse:
        async def stream() -> AsyncIterator[ext_proc.ProcessingRequest]:
            for message in messages:
                yield message

        answers = [answer async for answer in picker.Process(stream(), None)]  # type: ignore[arg-type]
        return answers[-1]

    async def scenario() -> None:
        client = aioredis.from_url(redis_server.url)
        await client.flushdb()
        now = time.time()
        records = [
            _replica("a", 300, reported=now, port=8001),
            _replica("b", 200, reported=now, port=8002),
            _replica("c", 100, reported=now, port=8003),
        ]
        for record in records:
            await client.set(record_key("m", record.replica_id), record.model_dump_json())
        metrics = GatewayMetrics("pagefleet_picker")
        core = RoutingCore(PickerSettings(redis_url=redis_server.url, policy="least_requests"), metrics)
        await core.registry.refresh()
        pool = UpstreamPool(1.0, 5.0)
        director = core.director(pool, OutlierDetector(core.registry, 3, 10.0), attempts=2)
        picker = EndpointPicker(core, director, fallbacks=1)
        body = {"model": "m", "prompt": "hi"}
        a, b, c = (endpoint(r.url) for r in records)

        answer = await pick(picker, _exchange(body))
        mutation = answer.request_body.response.header_mutation.set_headers[0].header
        assert (mutation.key, mutation.raw_value.decode()) == (DESTINATION, f"{a},{b}")
        assert answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value == f"{a},{b}"

        answer = await pick(picker, _exchange(body, subset=[b, c]))
        assert answer.request_body.response.header_mutation.set_headers[0].header.raw_value.decode().startswith(b)

        refused = await pick(picker, _exchange(body, subset=["10.9.9.9:1"]))
        assert refused.immediate_response.status.code == 503
        assert json.loads(refused.immediate_response.body)["error"]["code"] == 503
        pool.close()
        await core.close()

    asyncio.run(scenario())


def test_endpoints_are_ip_and_port_with_ipv6_in_brackets() -> None:
    assert endpoint("http://10.1.2.3:8000") == "10.1.2.3:8000"
    assert endpoint("http://[fd00::1]:8000/") == "[fd00::1]:8000"
    assert endpoint("http://pod.example") == "pod.example:80"


def test_histogram_quantile_interpolates_as_prometheus_does() -> None:
    from pagefleet.gateway.history import histogram_quantile

    buckets = {0.1: 10.0, 0.5: 30.0, 1.0: 40.0, float("inf"): 40.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.99, {1.0: 1.0, float("inf"): 5.0}) == 1.0  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, {1.0: 0.0, float("inf"): 0.0}) is None


def test_history_charts_rates_gauges_and_percentiles_over_the_window() -> None:
    from pagefleet.gateway.history import FleetHistory, Snapshot

    registry = ReplicaRegistry(None, 0.2, 3.0, 30.0)  # type: ignore[arg-type]  # never refreshed here
    history = FleetHistory(registry, GatewayMetrics(), interval=1.0, span=60.0, window=2.0)
    for second, tokens, ttft_fast in [(0, 0, 0), (1, 10, 1), (2, 30, 2), (3, 30, 2), (4, 0, 0)]:  # restarted at 4
        snapshot = Snapshot(1000.0 + second)
        snapshot.add(("m", "kv_usage", "r1"), 10.0 * second)
        snapshot.add(("m", "output_tokens", "r1"), tokens)
        snapshot.add_buckets(("m", "ttft", ""), 0.1, ttft_fast)
        snapshot.add_buckets(("m", "ttft", ""), float("inf"), ttft_fast)
        if second >= 2:  # a replica that ran long before it appeared, and a gateway counter made at t=3
            snapshot.add(("m", "output_tokens", "r2"), 500.0 + 10 * (second - 2))
        if second >= 3:
            snapshot.add(("m", "requests", "requests"), 2.0 * (second - 2))
        history.snapshots.append(snapshot)
    charts = {chart["id"]: chart["series"] for chart in history.charts("m")}
    assert charts["kv_usage"] == [{"name": "r1", "points": [[1000.0 + s, 10.0 * s] for s in range(5)]}]
    # rate over 2 s: (10-0)/1 at t=1 (only one earlier sample), (30-0)/2, (30-10)/2, then a reset: 0/2
    assert charts["output_tokens"] == [
        {"name": "r1", "points": [[1001.0, 10.0], [1002.0, 15.0], [1003.0, 10.0], [1004.0, 0.0]]},
        {"name": "r2", "points": [[1004.0, 10.0]]},  # a rate once two of its samples are in the window
    ]
    assert charts["requests"] == [{"name": "requests", "points": [[1003.0, 1.0], [1004.0, 2.0]]}]  # from 0
    ttft = {series["name"]: [value for _, value in series["points"]] for series in charts["ttft"]}
    # one request (of 0.1 s at most) a second until t=2, none after; a gap once none is in the window
    assert ttft["p50"] == [pytest.approx(0.05)] * 3 + [None]
    assert charts["free_blocks"] == []


def test_a_large_fleets_replicas_are_scraped_for_the_dashboard_only_while_it_is_watched() -> None:
    """Past ALWAYS_SCRAPED replicas, their /metrics are read only after the dashboard asked
    for its charts; their records are sampled either way."""
    from prometheus_client import CollectorRegistry, Counter

    from pagefleet.gateway.history import ALWAYS_SCRAPED, FleetHistory
    from pagefleet.runtime.metrics_http import serve_metrics
    from tests.processes import free_port

    replica_metrics, port = CollectorRegistry(), free_port()
    Counter("pagefleet:generation_tokens", "tokens", registry=replica_metrics).inc(7)
    server = serve_metrics(replica_metrics, port, "127.0.0.1")
    registry = ReplicaRegistry(None, 0.2, 3.0, 30.0)  # type: ignore[arg-type]  # never refreshed here
    records = [
        ReplicaRecord(replica_id=f"r{i}", model="m", url=f"http://127.0.0.1:{port}", free_blocks=5, total_blocks=10,
                      block_size=16, running=0, waiting=0, max_model_len=64)
        for i in range(ALWAYS_SCRAPED + 1)
    ]  # fmt: skip
    registry.by_model = {"m": records}
    history = FleetHistory(registry, GatewayMetrics())

    async def tokens_in_a_sample() -> float:
        snapshot = await history.sample()
        assert snapshot.values[("m", "free_blocks", "r0")] == 5
        return snapshot.values.get(("m", "output_tokens", "r0"), 0.0)

    async def scenario() -> None:
        assert await tokens_in_a_sample() == 0.0
        history.charts("m")
        assert await tokens_in_a_sample() == 7.0
        registry.by_model = {"m": records[:ALWAYS_SCRAPED]}
        history._watched_until = 0.0
        assert await tokens_in_a_sample() == 7.0  # a small fleet: always
        await history.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()


def test_metrics_on_their_own_port_keep_their_names_whatever_format_the_scraper_asks() -> None:
    """Prometheus asks for OpenMetrics, in which prometheus_client would escape the `:` of
    `pagefleet_picker:requests_total`; the picker's and the operator's port answer in the
    text format, as the gateway's and the engine's /metrics do."""
    import httpx

    from pagefleet.runtime.metrics_http import serve_metrics
    from tests.processes import free_port

    metrics, port = GatewayMetrics("pagefleet_picker"), free_port()
    metrics.requests.labels("m", "r1", "200").inc()
    server = serve_metrics(metrics.registry, port, "127.0.0.1")
    try:
        for accept in ("application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5", "*/*", ""):
            answer = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"accept": accept})
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
            assert 'pagefleet_picker:requests_total{model="m",replica="r1",status="200"} 1.0' in answer.text
    finally:
        server.close()


def test_a_model_scaled_to_zero_holds_its_requests_until_a_replica_publishes(redis_server: RedisProcess) -> None:
    """Known with no replica (`pagefleet:scalable:<model>`): requests wait, ask for a replica
    in Redis, and go in the order they came once one publishes; past the bounds, 503s."""

    async def scenario() -> None:
        client = aioredis.from_url(redis_server.url)
        await client.flushdb()
        await client.set(scalable_key("idle"), "{}")
        registry = ReplicaRegistry(client, 0.1, 60, 30)
        await registry.refresh()
        limiter, metrics = RateLimiter(client, 0, 0), GatewayMetrics()
        admission = Admission(
            set(), registry, limiter, metrics, DemandSignal(client), hold_timeout=5, hold_max_requests=3
        )
        body = json.dumps({"model": "idle", "prompt": "hi"}).encode()
        order: list[int] = []

        async def ask(index: int) -> None:
            await admission.admit("", body, chat=False)
            order.append(index)

        held = []
        for index in range(3):
            held.append(asyncio.create_task(ask(index)))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not order and read_demand(await client.get(demand_key("idle"))) is not None
        with pytest.raises(Refusal) as full:  # a fourth is one too many
            await admission.admit("", body, chat=False)
        assert full.value.status == 503 and full.value.headers["Retry-After"] == "5"
        with pytest.raises(Refusal) as unknown:  # nothing is held for a model nobody runs
            await admission.admit("", json.dumps({"model": "nobody", "prompt": "hi"}).encode(), chat=False)
        assert unknown.value.status == 404
        record = _replica("a", 10, reported=time.time()).model_copy(update={"model": "idle"})
        await client.set(record_key("idle", "a"), record.model_dump_json())
        await registry.refresh()
        await asyncio.gather(*held)
        assert order == [0, 1, 2]
        await client.delete(record_key("idle", "a"))
        await registry.refresh()
        admission.hold_timeout = 0.3
        with pytest.raises(Refusal) as late:
            await admission.admit("", body, chat=False)
        assert late.value.status == 503 and "within 0.3 s" in late.value.message
        await client.aclose()

    asyncio.run(scenario())


def test_both_front_doors_name_the_routes_kv_peer_and_only_the_routes() -> None:
    """The gateway and the picker send the replica the peer the route names (a bug before:
    the picker never did, and the gateway's tracing overwrote the header), never one the
    client sent, and never the replica itself."""
    from pagefleet.gateway.picker import routed_headers
    from pagefleet.gateway.proxy import upstream_headers
    from pagefleet.gateway.route import Route
    from pagefleet.protocol.headers import KV_PEER_HEADER

    chosen, holder = _replica("chosen"), _replica("holder", port=8001)
    pulling = Route(chosen, kv_peer=holder.url)
    trace = b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
    sent = upstream_headers(b"authorization: Bearer k\r\n", pulling, trace)
    assert sent == b"authorization: Bearer k\r\n" + f"{KV_PEER_HEADER}: {holder.url}\r\n".encode() + trace
    for no_peer in (Route(chosen), Route(chosen, kv_peer=chosen.url)):
        assert upstream_headers(b"", no_peer, trace) == trace

    mutation = routed_headers("10.0.0.1:8000", pulling, None)
    assert {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers} == {
        DESTINATION: "10.0.0.1:8000",
        KV_PEER_HEADER: holder.url,
    }
    assert list(mutation.remove_headers) == []
    for no_peer in (Route(chosen), Route(chosen, kv_peer=chosen.url), None):
        mutation = routed_headers("10.0.0.1:8000", no_peer, 12)
        assert {h.header.key for h in mutation.set_headers} == {DESTINATION, "content-length"}
        assert list(mutation.remove_headers) == [KV_PEER_HEADER]  # a client's own never reaches the replica


def test_a_responses_input_with_parts_of_any_json_is_described_not_raised() -> None:
    """Found by the fuzz test: content parts whose `text` is not a string (a number, a list)
    count as no text; the replica refuses the body with a 400."""
    from pagefleet.gateway.shape import describe

    item = {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": 5.6e16}]}
    body = {"model": "tiny", "input": [item, {"role": "user", "content": [{"text": ["x"]}, {"text": "hello"}]}]}
    shape = describe(json.dumps(body).encode(), chat=True)
    assert shape.model == "tiny" and shape.prompt_tokens > 0
