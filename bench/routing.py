"""Routers compared on the workload shapes where routing matters, in front of the same replicas.

    python bench/routing.py [--workloads shared,sessions,decode] [--routers ...] [--runs 1]
                            [--json results.json] [--plot docs/routing-goodput.png]
    python bench/routing.py --simulate gpu-8b --replicas 8,32,128 --time-scale 25
                            [--workloads b2b-saas,chat,decode-control]

With `--simulate PROFILE`, the replicas are a `pagefleet sim-fleet` of that many simulated
replicas (engine/sim: the real server and scheduler over the profile's cost model), and the
workloads are llm-d's shapes at full size (routing_workloads.py). The arrival schedule is
stretched by the time scale and every figure converted back to the profile's time; each cell
also reports the CPU the simulated replicas used (in cores of this machine: below 2, nothing
waited for a core) and the router's CPU per request.

Three `pagefleet serve` replicas of SmolLM2-135M-Instruct (float32, each at its defaults but
for a small KV budget: 250 blocks of 16 tokens, 4,000 token slots), one Redis. In front of
the same replicas, one router at a time: pagefleet's gateway with `affinity` (its default),
`kv` and `round_robin`; vLLM's router (PyPI `vllm-router`, installed into `.peers/`) with
`cache_aware` (its default), `sticky_least_loaded`, `consistent_hash`, `power_of_two` and
`round_robin`. Every router replays the same arrival schedule at each rate, on replicas
whose prefix caches were emptied first (`POST /reset_prefix_cache`). With `--kv-tiers on`
(or `both`: on, then off, in one run) the replicas run as `pagefleet up` runs them, with a
shared file tier (emptied before every cell too) and peer pulls (docs/kv-tiers.md).

Reported per workload, router and rate: goodput (requests whose TTFT met the SLO, per
second of the run), TTFT p50/p90/p99, inter-token latency p50/p99, the share of prompt
tokens served from cache, preemptions per replica; then, per router, its goodput at the
knee (the best over the rates) and the ratios the issue's targets name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
from common import free_port, free_port_range, progress
from peers import vllm_router_binary
from routing_workloads import FULL_SIZE_WORKLOADS, WORKLOADS, Outcome, replay, stretched

from pagefleet.cli.up import Fleet, FleetSpec, ModelSpec

MODEL = "smollm2-135m-instruct"
REPLICAS = 3
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "250"]
PAGEFLEET_POLICIES = ["affinity", "kv", "round_robin"]
VLLM_ROUTER_POLICIES = ["cache_aware", "sticky_least_loaded", "consistent_hash", "power_of_two", "round_robin"]
ROUTERS = [f"pagefleet:{p}" for p in PAGEFLEET_POLICIES] + [f"vllm-router:{p}" for p in VLLM_ROUTER_POLICIES]
RATES = {"shared": [1.0, 2.0, 4.0], "sessions": [0.2, 0.4, 0.8], "decode": [0.5, 1.0, 2.0]}
# Simulated GPU fleets: offered requests per second and replica, in the profile's time.
RATES_PER_REPLICA = {"b2b-saas": [2.0, 6.0, 12.0], "chat": [1.0, 3.0, 6.0], "decode-control": [0.5, 1.0, 2.0]}
# Enough that the 8 first sightings of `shared`'s prompts, which no router can serve from
# cache, are under a tenth of a cell: its p90 then measures routing, not the cold start.
REQUESTS = {"shared": 100, "sessions": 48, "decode": 32, "b2b-saas": 1200, "chat": 600, "decode-control": 400}


def start_fleet(log_dir: Path, kv_tiers: bool = False) -> tuple[Fleet, list[str]]:
    """The replicas; with `kv_tiers`, as `pagefleet up` runs them (a shared file tier, peer
    pulls), else each computes what it has not cached itself (docs/kv-tiers.md)."""
    flags = ENGINE_FLAGS if kv_tiers else [*ENGINE_FLAGS, "--kv-peer-pulls", "off"]
    spec = FleetSpec(
        kv_tier=kv_tiers,
        redis_port=free_port(),
        gateway_port=free_port(),
        first_engine_port=free_port(),
        log_dir=log_dir,
        models=[ModelSpec(name=MODEL, model=MODEL, replicas=REPLICAS, flags=flags)],
    )
    fleet = Fleet(spec)
    deadline = time.monotonic() + 600
    fleet.start_redis()
    urls = [fleet.start_engine(spec.models[0], i).url for i in range(REPLICAS)]
    for url in urls:
        fleet.wait_healthy(url, deadline)
    return fleet, urls


@dataclass
class Target:
    """The replicas under test: a real fleet, or a simulated one whose `time_scale` stretches
    every modelled duration (figures are converted back to the profile's time)."""

    fleet: Fleet
    replicas: list[str]
    model: str = MODEL
    time_scale: float = 1.0
    hosts: list[psutil.Process] = field(default_factory=list)  # the simulated replicas' processes


def start_sim_fleet(log_dir: Path, profile: str, replicas: int, time_scale: float, flags: list[str]) -> Target:
    """`pagefleet sim-fleet` with `replicas` simulated replicas of `profile` (and their
    `flags`), one Redis."""
    spec = FleetSpec(kv_tier=False, redis_port=free_port(), gateway_port=free_port(), log_dir=log_dir, models=[])
    fleet = Fleet(spec)
    fleet.start_redis()
    base = free_port_range(replicas)
    command = [
        sys.executable,
        "-m",
        "pagefleet.cli.main",
        "sim-fleet",
        "--replicas",
        str(replicas),
        "--profile",
        profile,
    ]
    command += ["--time-scale", str(time_scale), "--base-port", str(base), "--redis-url", fleet.redis_url]
    command += ["--enable-prompt-tokens-details", "--max-waiting-requests", "100000", *flags]
    child = fleet.spawn("sim-fleet", command)
    urls = [f"http://127.0.0.1:{base + i}" for i in range(replicas)]
    deadline = time.monotonic() + 900
    for url in urls:
        fleet.wait_healthy(url, deadline)
    hosts = psutil.Process(child.process.pid).children()
    return Target(fleet, urls, f"sim-{profile}", time_scale, hosts)


def cpu_seconds(processes: list[psutil.Process]) -> float:
    """User and system CPU the processes used so far."""
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def start_router(fleet: Fleet, router: str, replicas: list[str], model: str = MODEL) -> tuple[str, psutil.Process]:
    """One router in front of the replicas, as a child of the fleet; its URL once it
    serves, and its process."""
    kind, policy = router.split(":")
    port = free_port()
    if kind == "pagefleet":
        command = [sys.executable, "-m", "pagefleet.cli.main", "gateway", "--host", "127.0.0.1", "--port", str(port)]
        command += ["--redis-url", fleet.redis_url, "--policy", policy, "--log-level", "WARNING"]
    else:
        command = [str(vllm_router_binary()), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *replicas]
        command += ["--policy", policy, "--log-level", "warning", "--prometheus-port", str(free_port())]
    process = psutil.Process(fleet.spawn(router.replace(":", "-"), command).process.pid)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        fleet.check_alive()
        try:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            if httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10).status_code == 200:
                time.sleep(2.0)  # pagefleet's gateway reads the tokenizer once it sees replicas
                return url, process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{router} did not serve in time")


def stop_router(fleet: Fleet, router: str) -> None:
    name = router.replace(":", "-")
    for child in [c for c in fleet.children if c.name == name]:
        child.process.terminate()
        child.process.wait(timeout=30)
        fleet.children.remove(child)


def reset_caches(replicas: list[str], tier: Path | None = None) -> None:
    """Wait until every replica is idle, then empty its prefix cache (and the file tier)."""
    if tier is not None:
        for path in tier.rglob("*.kv"):
            path.unlink(missing_ok=True)
    deadline = time.monotonic() + 300
    pending = list(replicas)
    while pending and time.monotonic() < deadline:
        pending = [url for url in pending if httpx.post(f"{url}/reset_prefix_cache", timeout=10).status_code != 200]
        if pending:
            time.sleep(0.5)
    if pending:
        raise SystemExit(f"replicas still busy after 300 s: {pending}")


def preemptions(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("pagefleet:num_preemptions_total")
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(outcomes: list[Outcome], seconds: float, slo_s: float, preempted: list[float]) -> dict[str, object]:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft for o in ok]
    gaps = [g for o in ok for g in o.gaps]
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(ok),
        "failures": dict(Counter(o.error for o in outcomes if not o.ok).most_common(5)),
        "goodput": sum(1 for t in ttft if t <= slo_s) / seconds,
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p90": percentile(ttft, 0.9),
        "ttft_p99": percentile(ttft, 0.99),
        "itl_p50": percentile(gaps, 0.5),
        "itl_p99": percentile(gaps, 0.99),
        "cached": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
        "preemptions": preempted,
        "seconds": seconds,
    }


def run_cell(
    url: str,
    target: Target,
    workload: str,
    rate: float,
    seed: int,
    slo_s: float,
    requests: int,
    tier: Path | None = None,
    router: psutil.Process | None = None,
) -> dict[str, object]:
    """One router at one offered load (requests/s in the profile's time); every duration
    reported is in the profile's time (wall time over the time scale)."""
    replicas, scale = target.replicas, target.time_scale
    reset_caches(replicas, tier)
    before, counters_before = [preemptions(r) for r in replicas], gateway_counters(url)
    shape = WORKLOADS.get(workload) or FULL_SIZE_WORKLOADS[workload]
    turns = stretched(shape(rate, requests or REQUESTS[workload], seed), scale)
    cpu_before = (cpu_seconds(target.hosts), cpu_seconds([router]) if router is not None else 0.0)
    outcomes, seconds = asyncio.run(replay(url, target.model, turns, timeout_s=600.0 * max(1.0, scale)))
    host_cpu = cpu_seconds(target.hosts) - cpu_before[0]
    router_cpu = (cpu_seconds([router]) if router is not None else 0.0) - cpu_before[1]
    after, counters_after = [preemptions(r) for r in replicas], gateway_counters(url)
    for outcome in outcomes:
        outcome.ttft /= scale
        outcome.gaps = [gap / scale for gap in outcome.gaps]
    cell = summarize(outcomes, seconds / scale, slo_s, [a - b for a, b in zip(after, before, strict=True)])
    cell.update(_decisions(counters_before, counters_after))
    cell["host_cores"] = host_cpu / seconds  # the simulated replicas' CPU, in cores of this machine
    cell["router_cpu_ms"] = 1000 * router_cpu / max(1, len(outcomes))
    return cell


def gateway_counters(url: str) -> dict[str, float]:
    """pagefleet's gateway: its affinity decisions so far by reason (`reason:<name>`), and its
    routing decisions' count, seconds and count within 1 ms (`decisions`, `decision_s`,
    `decisions_1ms`). Empty for other routers."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    counters: dict[str, float] = {}
    names = {
        "pagefleet_gateway:routing_decision_seconds_count{": "decisions",
        "pagefleet_gateway:routing_decision_seconds_sum{": "decision_s",
        'pagefleet_gateway:routing_decision_seconds_bucket{le="0.001",': "decisions_1ms",
    }
    for line in text.splitlines():
        if line.startswith("pagefleet_gateway:routing_reasons_total{"):
            key = "reason:" + line.split('reason="')[1].split('"')[0]
        else:
            key = next((name for prefix, name in names.items() if line.startswith(prefix)), "")
        if key:
            counters[key] = counters.get(key, 0.0) + float(line.split()[-1])
    return counters


def _decisions(before: dict[str, float], after: dict[str, float]) -> dict[str, object]:
    """A cell's affinity reasons, and its decisions' mean time (ms) and share within 1 ms."""
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    count = delta.get("decisions", 0.0)
    return {
        "reasons": {k.removeprefix("reason:"): v for k, v in delta.items() if k.startswith("reason:")},
        "decision_ms": 1000 * delta["decision_s"] / count if count else float("nan"),
        "decisions_1ms": delta["decisions_1ms"] / count if count else float("nan"),
    }


def _reasons(cell: dict[str, object]) -> str:
    reasons = cell.get("reasons") or {}
    return ", ".join(f"{k} {v:.0f}" for k, v in reasons.items() if v) or "-"  # type: ignore[union-attr]


def _decision(cell: dict[str, object]) -> str:
    mean, within = cell.get("decision_ms"), cell.get("decisions_1ms")
    if not isinstance(mean, float) or mean != mean:  # another router, or an older result
        return "-"
    return f"{mean:.2f} ms, {within:.0%}"


def _preemptions(cell: dict[str, object]) -> str:
    """Per replica for a few, their sum for a fleet."""
    counts = cell["preemptions"]
    assert isinstance(counts, list)
    return str(counts) if len(counts) <= 4 else f"{sum(counts):.0f} in all"


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def report(workload: str, cells: dict[str, dict[float, dict[str, object]]]) -> list[str]:
    lines = [
        f"## {workload}",
        "",
        "| router | rate/s | goodput/s | TTFT p50 | p90 | p99 | ITL p50 | p99 | cached | preemptions | failed "
        "| reasons | host cores | router CPU/request | decision mean, within 1 ms |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for router, by_rate in cells.items():
        for rate, c in by_rate.items():
            lines.append(
                f"| {router} | {rate:g} | {c['goodput']:.3f} | {c['ttft_p50']:.2f} | {c['ttft_p90']:.2f} | "
                f"{c['ttft_p99']:.2f} | {c['itl_p50'] * 1000:.0f} ms | {c['itl_p99'] * 1000:.0f} ms | "
                f"{c['cached']:.0%} | {_preemptions(c)} | {c['failed']} | {_reasons(c)} | "
                f"{c.get('host_cores', float('nan')):.2f} | {c.get('router_cpu_ms', float('nan')):.2f} ms | "
                f"{_decision(c)} |"
            )
    knee = {router: max(float(c["goodput"]) for c in by_rate.values()) for router, by_rate in cells.items()}
    lines += ["", "Goodput at the knee (best over the rates):", ""]
    lines += [f"- {router}: {value:.3f}/s" for router, value in knee.items()]
    if "pagefleet:affinity +kv-tiers" in knee and "pagefleet:affinity" in knee:
        tiers = ratio(knee["pagefleet:affinity +kv-tiers"], knee["pagefleet:affinity"])
        lines += ["", f"- affinity with the KV tiers / without: {tiers:.2f}x"]
    ours = knee.get("pagefleet:affinity")
    peers = {r: v for r, v in knee.items() if r.startswith("vllm-router")}
    if ours is not None:
        lines.append("")
        if "pagefleet:round_robin" in knee:
            lines.append(
                f"- affinity / round robin: {ratio(ours, knee['pagefleet:round_robin']):.2f}x (target >= 2.0x)"
            )
        if peers:
            best = max(peers, key=peers.__getitem__)
            lines.append(f"- affinity / best vllm-router ({best}): {ratio(ours, peers[best]):.2f}x (target >= 1.25x)")
        aware = cells.get("vllm-router:cache_aware", {})
        for rate, cell in cells["pagefleet:affinity"].items():
            if rate in aware and aware[rate]["ttft_p90"]:
                p90 = ratio(float(cell["ttft_p90"]), float(aware[rate]["ttft_p90"]))
                lines.append(
                    f"- p90 TTFT at {rate:g}/s, affinity / vllm-router cache_aware: {p90:.2f}x (target <= 0.5x)"
                )
    return lines


def plot(results: dict[str, dict[str, dict[float, dict[str, object]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    routers = list(dict.fromkeys(router for cells in results.values() for router in cells))
    for axis, (workload, cells) in zip(axes[0], results.items(), strict=True):
        for router, by_rate in cells.items():
            rates = sorted(by_rate)
            style = "-" if router.startswith("pagefleet") else "--"
            color = f"C{routers.index(router) % 10}"  # one colour per router in every panel
            axis.plot(rates, [by_rate[r]["goodput"] for r in rates], style, marker="o", color=color, label=router)
        axis.set_title(f"{workload}: goodput by offered load")
        axis.set_xlabel("requests (sessions) per second offered")
        axis.set_ylabel("requests meeting the TTFT SLO per second")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    progress(f"plot written to {path}")


def run_workloads(
    args: argparse.Namespace,
    target: Target,
    routers: list[str],
    results: dict[str, dict[str, dict[float, dict[str, object]]]],
    title: str,
    kv_tiers: bool = False,
) -> None:
    """Every run, workload, router and rate of `args` on `target`, into `results`."""
    models = target.fleet.spec.models
    tier = target.fleet.spec.kv_dir(models[0]) if models else None
    for run in range(args.first_run - 1, args.first_run - 1 + args.runs):
        for workload in args.workloads.split(","):
            rates = [float(r) for r in args.rates.split(",")] if args.rates else default_rates(workload, target)
            name = f"{title}{workload} (run {run + 1})"
            cells = results.setdefault(name, {})
            for router in routers:
                label = f"{router} +kv-tiers" if kv_tiers else router
                url, process = start_router(target.fleet, router, target.replicas, target.model)
                try:
                    for rate in rates:
                        progress(f"{name}, {label}, {rate:g}/s")
                        cell = run_cell(url, target, workload, rate, run, args.slo_s, args.requests, tier, process)
                        cells.setdefault(label, {})[rate] = cell
                        if cell["failures"]:
                            progress(f"failed requests, most common first: {cell['failures']}")
                        save(args.json, results)  # after every cell: a long run keeps what it measured
                finally:
                    stop_router(target.fleet, router)
            print("\n".join(report(name, cells)), flush=True)


def fidelity(results: dict[str, dict[str, dict[float, dict[str, object]]]]) -> list[str]:
    """Simulated over real, per workload, router and rate: TTFT p50 and p90, goodput."""
    lines = ["## Simulated fleet / real fleet", "", "| workload | router | rate/s | TTFT p50 | TTFT p90 | goodput |"]
    lines.append("|---|---|---|---|---|---|")
    for name, cells in results.items():
        simulated = results.get(f"simulated, {name}")
        if simulated is None:
            continue
        for router, by_rate in cells.items():
            for rate, real in by_rate.items():
                sim = simulated.get(router, {}).get(rate)
                if sim is None:
                    continue
                shares = [ratio(float(sim[k]), float(real[k])) for k in ("ttft_p50", "ttft_p90", "goodput")]
                lines.append(f"| {name} | {router} | {rate:g} | " + " | ".join(f"{x:.2f}x" for x in shares) + " |")
    return lines


def save(path: Path | None, results: dict[str, dict[str, dict[float, dict[str, object]]]]) -> None:
    """Merge `results` into the JSON file at `path` (if any)."""
    if path is None:
        return
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing.update(
        {w: {r: {str(k): v for k, v in c.items()} for r, c in cells.items()} for w, cells in results.items()}
    )
    path.write_text(json.dumps(existing, indent=1))


def default_rates(workload: str, target: Target) -> list[float]:
    if workload in RATES:
        return RATES[workload]
    return [rate * len(target.replicas) for rate in RATES_PER_REPLICA[workload]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=None, help="default: shared,sessions,decode (simulated: full size)")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--rates", default="", help="override every workload's rates, e.g. 0.5,1,2")
    parser.add_argument("--requests", type=int, default=0, help="requests per cell (default: per workload)")
    parser.add_argument("--runs", type=int, default=1, help="repeat with other seeds; each run is reported")
    parser.add_argument("--first-run", type=int, default=1, help="number (and seed) of the first run")
    parser.add_argument("--slo-s", type=float, default=1.0, help="the TTFT objective of goodput")
    parser.add_argument("--json", type=Path, default=None, help="append the results here")
    parser.add_argument("--plot", type=Path, default=None, help="goodput by load, per workload (PNG)")
    parser.add_argument("--from-json", type=Path, nargs="+", help="report and plot saved results; run nothing")
    parser.add_argument(
        "--kv-tiers", choices=["off", "on", "both"], default="off", help="the replicas' file tier and peer pulls"
    )
    parser.add_argument("--simulate", default=None, help="a profile: fleets of simulated replicas (engine/sim)")
    parser.add_argument("--replicas", default="8,32,128", help="with --simulate: the fleet sizes")
    parser.add_argument("--time-scale", type=float, default=25.0, help="with --simulate: modelled durations x K")
    parser.add_argument(
        "--against-real",
        action="store_true",
        help="with --simulate cpu-smollm2: the real three replicas first, then as many simulated, and their ratios",
    )
    args = parser.parse_args()
    if args.from_json:
        saved: dict[str, dict[str, dict[float, dict[str, object]]]] = {}
        for path in args.from_json:
            for workload, cells in json.loads(path.read_text()).items():
                saved[workload] = {r: {float(k): v for k, v in c.items()} for r, c in cells.items()}
        for workload, cells in saved.items():
            print("\n".join(report(workload, cells)), flush=True)
        if args.plot:
            plot(saved, args.plot)
        return
    routers = args.routers.split(",")
    args.workloads = args.workloads or ",".join(FULL_SIZE_WORKLOADS if args.simulate else WORKLOADS)
    results: dict[str, dict[str, dict[float, dict[str, object]]]] = {}
    if args.against_real or not args.simulate:
        settings = {"off": [False], "on": [True], "both": [True, False]}[args.kv_tiers]
        with tempfile.TemporaryDirectory() as scratch:
            for kv_tiers in settings:
                fleet, urls = start_fleet(Path(scratch) / f"fleet-{kv_tiers}" / "logs", kv_tiers)
                try:
                    run_workloads(args, Target(fleet, urls), routers, results, "", kv_tiers)
                finally:
                    fleet.stop()
    if args.simulate:
        sizes = [REPLICAS] if args.against_real else [int(n) for n in args.replicas.split(",")]
        flags = ENGINE_FLAGS if args.against_real else []  # the real replicas' KV budget
        for replicas in sizes:
            with tempfile.TemporaryDirectory() as scratch:
                target = start_sim_fleet(Path(scratch) / "logs", args.simulate, replicas, args.time_scale, flags)
                try:
                    title = "simulated, " if args.against_real else f"{replicas} x {args.simulate}, "
                    run_workloads(args, target, routers, results, title)
                finally:
                    target.fleet.stop()
    if args.against_real:
        print("\n".join(fidelity(results)), flush=True)
    save(args.json, results)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
