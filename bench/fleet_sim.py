"""Routing at scale, by simulation: the gateway's real decision code over simulated replicas.

    python bench/fleet_sim.py [--replicas 8,32,128] [--profile gpu-8b|cpu-smollm2]

A discrete-event simulation of llm-d's b2b-saas shape at full size: 150 system prompts of
6,000 tokens, each request one of them (Zipf-distributed, as tenants are) plus a 100-token
question, 64 answer tokens, Poisson arrivals. Each simulated replica has a prefix cache of
a fixed number of blocks (LRU over the blocks of finished prompts), prefills one request at
a time at its calibrated rate (uncached tokens only), and reports its queue every 0.5 s,
as real replicas do; the router sees the reports, the exact prefix index (as the fleet's
index in Redis gives it) and what it sent since each report.

Policies: `affinity` runs `gateway.decision.decide` and `gateway.prefix_index.ModelIndex`,
the code the gateway runs; `load` is the same decision with no index (the old `kv`);
`round_robin`; `consistent_hash` on the system prompt (what session or prefix hashing
routers do, with no load valve).

Profiles: `cpu-smollm2` (this machine: 2,000 prompt tokens/s, 4,000-token caches) and
`gpu-8b` (a Llama-3-8B replica on one H100, from published figures: about 20,000 prompt
tokens/s, 450,000 cached tokens). Reports goodput (requests whose TTFT met the SLO per
second) at offered loads around the fleet's capacity, and the decision's cost per request.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pagefleet.gateway.decision import Candidate, decide
from pagefleet.gateway.inflight import InFlight
from pagefleet.gateway.prefix_index import ModelIndex
from pagefleet.protocol.replica import ReplicaRecord

BLOCK = 16
POLICIES = ("affinity", "load", "round_robin", "consistent_hash")
REPORT_S = 0.5
PROFILES = {  # prefill tokens/s, cached tokens per replica, TTFT SLO s, system prompts, their tokens, question tokens
    "cpu-smollm2": (2_000.0, 4_000, 1.0, 8, 900, 20),  # bench/routing.py's `shared` shape
    "gpu-8b": (20_000.0, 450_000, 1.0, 150, 6_000, 100),  # llm-d's b2b-saas at full size
}


@dataclass(slots=True)
class Request:
    arrival: float
    system: int  # which system prompt
    blocks: list[int]  # its prompt's block hashes, chained: system blocks then its own
    tokens: int
    expected: int = 0  # uncached tokens when it reached its replica (what the replica reports)


@dataclass
class SimReplica:
    replica_id: str
    rate: float
    capacity_blocks: int
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)  # LRU of cached block hashes
    queued_tokens: int = 0  # uncached prompt tokens not yet prefilled
    report: ReplicaRecord | None = None

    def cached_prefix(self, blocks: list[int]) -> int:
        count = 0
        for block in blocks:
            if block not in self.cache:
                break
            count += 1
        return count

    def store(self, blocks: list[int], index: ModelIndex) -> None:
        for block in blocks:
            self.cache[block] = None
            self.cache.move_to_end(block)
        index.store(self.replica_id, blocks)
        evicted = []
        while len(self.cache) > self.capacity_blocks:
            evicted.append(self.cache.popitem(last=False)[0])
        index.remove(self.replica_id, evicted)

    def make_report(self, now: float) -> ReplicaRecord:
        return ReplicaRecord(
            replica_id=self.replica_id,
            model="m",
            url=f"http://{self.replica_id}",
            free_blocks=self.capacity_blocks,  # cached blocks are evictable: free
            total_blocks=self.capacity_blocks,
            block_size=BLOCK,
            running=0,
            waiting=0,
            max_model_len=32768,
            waiting_prompt_tokens=self.queued_tokens,
            prefill_tokens_per_s=self.rate,
            timestamp=now,
        )


def workload(
    rate: float, count: int, seed: int, systems: int, system_tokens: int, question_tokens: int
) -> list[Request]:
    rng = random.Random(seed)
    weights = [1.0 / (rank + 1) for rank in range(systems)]  # Zipf: a few large tenants, a long tail
    serial = itertools.count(10**9)
    requests, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        system = rng.choices(range(systems), weights)[0]
        shared = [system * 10_000 + i for i in range(system_tokens // BLOCK)]
        own = [next(serial) for _ in range(question_tokens // BLOCK)]
        requests.append(Request(now, system, shared + own, system_tokens + question_tokens))
    return requests


class Router:
    """Chooses as the gateway does: `affinity` and `load` run its InFlight ledger (on the
    simulated clock) and its decision; the others are what peers' routers do."""

    def __init__(self, policy: str, replicas: list[SimReplica], index: ModelIndex, saturation_s: float) -> None:
        self.policy, self.replicas, self.index, self.saturation_s = policy, replicas, index, saturation_s
        self.turn = itertools.count()
        self.now = 0.0
        self.inflight = InFlight(clock=lambda: self.now)
        self.decision_s = 0.0

    def choose(self, request: Request, now: float) -> SimReplica:
        self.now = now
        if self.policy == "round_robin":
            return self.replicas[next(self.turn) % len(self.replicas)]
        if self.policy == "consistent_hash":
            return self.replicas[hash((request.system, 7)) % len(self.replicas)]
        started = time.perf_counter()
        ids = [r.replica_id for r in self.replicas]
        hashes = request.blocks if self.policy == "affinity" else []
        cached = self.index.matched_blocks(hashes, ids)
        sent_lately = self.inflight.matched_blocks(hashes, ids)
        views = []
        for replica in self.replicas:
            report = replica.report or replica.make_report(0.0)
            matched = max(cached[replica.replica_id], sent_lately[replica.replica_id])
            views.append(Candidate(report, matched, *self.inflight.promised(report)))
        decision = decide(views, request.tokens, self.saturation_s)
        uncached = request.tokens - decision.cached_blocks * BLOCK
        self.inflight.record(decision.replica, 0, uncached, hashes)
        self.decision_s += time.perf_counter() - started
        return next(r for r in self.replicas if r.replica_id == decision.replica.replica_id)


def simulate(policy: str, num_replicas: int, profile: str, rate: float, count: int, seed: int = 0) -> dict[str, float]:
    prefill_rate, cached_tokens, slo_s, systems, system_tokens, question_tokens = PROFILES[profile]
    replicas = [SimReplica(f"r{i}", prefill_rate, cached_tokens // BLOCK) for i in range(num_replicas)]
    index = ModelIndex()
    router = Router(policy, replicas, index, saturation_s=slo_s / 2)
    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()
    queues: dict[str, list[Request]] = {r.replica_id: [] for r in replicas}
    busy: set[str] = set()

    def start_next(replica: SimReplica, now: float) -> None:
        """Prefill the replica's next request: prefix hits are decided now, as the engine does."""
        queue = queues[replica.replica_id]
        if not queue:
            busy.discard(replica.replica_id)
            return
        busy.add(replica.replica_id)
        request = queue.pop(0)
        replica.queued_tokens -= request.expected
        uncached = request.tokens - replica.cached_prefix(request.blocks) * BLOCK
        heapq.heappush(events, (now + uncached / replica.rate, next(order), "done", (replica, request)))

    for request in workload(rate, count, seed, systems, system_tokens, question_tokens):
        heapq.heappush(events, (request.arrival, next(order), "arrive", request))
    for replica in replicas:
        heapq.heappush(events, (0.0, next(order), "report", replica))
    ttfts: list[float] = []
    last = 0.0
    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "report":
            replica = item  # type: ignore[assignment]
            replica.report = replica.make_report(now)  # type: ignore[union-attr]
            if len(ttfts) < count:
                heapq.heappush(events, (now + REPORT_S, next(order), "report", replica))
        elif kind == "arrive":
            request: Request = item  # type: ignore[assignment]
            replica = router.choose(request, now)
            request.expected = request.tokens - replica.cached_prefix(request.blocks) * BLOCK
            queues[replica.replica_id].append(request)
            replica.queued_tokens += request.expected
            if replica.replica_id not in busy:
                start_next(replica, now)
        else:
            replica, request = item  # type: ignore[misc]
            replica.store(request.blocks, index)
            ttfts.append(now - request.arrival)
            last = now
            start_next(replica, now)
    met = sum(1 for t in ttfts if t <= slo_s)
    return {
        "goodput": met / last,
        "ttft_p90": sorted(ttfts)[int(0.9 * len(ttfts))],
        "decision_ms": router.decision_s / count * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="8,32,128")
    parser.add_argument("--profile", default="gpu-8b", choices=sorted(PROFILES))
    parser.add_argument("--requests-per-replica", type=int, default=150)
    args = parser.parse_args()
    prefill_rate, _, _, _, system_tokens, question_tokens = PROFILES[args.profile]
    for num_replicas in [int(n) for n in args.replicas.split(",")]:
        # The load at which the fleet could prefill every prompt in full; caching decides
        # everything at a few times that.
        uncached_capacity = num_replicas * prefill_rate / (system_tokens + question_tokens)
        count = args.requests_per_replica * num_replicas
        for load in (1.0, 2.0, 3.0, 4.0):
            rate = load * uncached_capacity
            row = {p: simulate(p, num_replicas, args.profile, rate, count) for p in POLICIES}
            base = row["round_robin"]["goodput"] or float("nan")
            cells = " | ".join(
                f"{p} {r['goodput']:.1f}/s (x{r['goodput'] / base:.2f}) p90 {r['ttft_p90']:.2f}s"
                for p, r in row.items()
            )
            print(f"{args.profile}, {num_replicas} replicas, {rate:.1f} req/s offered: {cells}", flush=True)
        cost = row["affinity"]["decision_ms"]
        print(f"  affinity's decision per request at {num_replicas} replicas: {cost:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
