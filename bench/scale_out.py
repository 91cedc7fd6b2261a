"""A replica joining a warm fleet: its first minute's time to first token with the KV tiers
(the shared file tier and peer pulls) against without them, on the same load.

    python bench/scale_out.py [--rate 3] [--warm 40] [--requests 180] [--prompts 8]

Two `pagefleet serve` replicas of SmolLM2-135M-Instruct (float32, 250 KV blocks of 16
tokens, as bench/routing.py) and pagefleet's gateway (`affinity`, its default) serve the
`shared` workload of bench/routing_workloads.py (`--prompts` system prompts of about 930
tokens, a short question, 16 answer tokens) for `--warm` requests at `--rate` per second.
Then a third replica starts; once it is healthy, `--requests` more of the same workload
(the same system prompts) arrive at the same rate (a minute at the defaults). A replica's
250 blocks hold about four of the system prompts: at `--prompts 8` the warm fleet holds
them all, and at 16 it does not. Reported for the requests the new replica answered, and for all
of them: TTFT p50/p90 and the share of prompt tokens served from a cache. Run once per
`--settings` entry: `file+peer` (`pagefleet up`'s defaults: the file tier on,
`--kv-peer-pulls auto`), `file`, `peer`, `off`.
Target (issue 35): the new replica's TTFT p90 with the tiers at most 0.5x without.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
import time
from pathlib import Path

from common import free_port, progress
from routing import MODEL, percentile, start_router
from routing_workloads import Outcome, Turn, replay, shared_prompts

from pagefleet.cli.up import Fleet, FleetSpec, ModelSpec

ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "250"]


SETTINGS = {  # name: (the file tier, peer pulls)
    "file+peer": (True, "auto"),
    "file": (True, "off"),
    "peer": (False, "auto"),
    "off": (False, "off"),
}


def run(setting: str, load: list[Turn], warm: int, log_dir: Path) -> dict[str, dict[str, float]]:
    file_tier, pulls = SETTINGS[setting]
    model = ModelSpec(name=MODEL, model=MODEL, replicas=3, flags=[*ENGINE_FLAGS, "--kv-peer-pulls", pulls])
    spec = FleetSpec(
        kv_tier=file_tier,
        redis_port=free_port(),
        gateway_port=free_port(),
        first_engine_port=free_port(),
        log_dir=log_dir,
        models=[model],
    )
    fleet = Fleet(spec)
    try:
        fleet.start_redis()
        deadline = time.monotonic() + 600
        first = [fleet.start_engine(model, index) for index in range(2)]
        for replica in first:
            fleet.wait_healthy(replica.url, deadline)
        gateway = start_router(fleet, "pagefleet:affinity", [r.url for r in first])
        progress(f"{setting}: warming two replicas with {warm} requests")
        asyncio.run(replay(gateway, MODEL, load[:warm]))
        joining = fleet.start_engine(model, 2)
        fleet.wait_healthy(joining.url, deadline)
        time.sleep(1.5)  # the gateway sees its record
        rest = [dataclasses.replace(turn, at=turn.at - load[warm].at) for turn in load[warm:]]
        progress(f"{setting}: a third replica joined; {len(rest)} requests")
        outcomes, _ = asyncio.run(replay(gateway, MODEL, rest))
        new = [o for o in outcomes if o.replica == joining.replica_id]
        report_tiers(joining.url)
        return {"new replica": summary(new), "all": summary(outcomes)}
    finally:
        fleet.stop()


def report_tiers(url: str) -> None:
    """What the new replica's tiers did (its /metrics)."""
    import httpx

    wanted = (
        "pagefleet:kv_peer_pulls_total",
        "pagefleet:kv_tier_lookups_total",
        "pagefleet:kv_tier_hits_total",
        "pagefleet:kv_tier_refused_total",
        "pagefleet:prefix_cache_hits_total",
    )
    lines = [line for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines() if line.startswith(wanted)]
    progress("the new replica: " + "; ".join(lines))


def summary(outcomes: list[Outcome]) -> dict[str, float]:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft for o in ok]
    prompt = sum(o.prompt_tokens for o in ok)
    return {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(ok),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p90": percentile(ttft, 0.9),
        "cached": sum(o.cached_tokens for o in ok) / prompt if prompt else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--requests", type=int, default=180)
    parser.add_argument("--prompts", type=int, default=8, help="system prompts in the workload")
    parser.add_argument("--settings", default="file+peer,off", help=f"of {', '.join(SETTINGS)}")
    args = parser.parse_args()
    load = shared_prompts(args.rate, args.warm + args.requests, seed=1, prompts=args.prompts)
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for setting in args.settings.split(","):
            results[setting] = run(setting, load, args.warm, Path(folder) / setting / "logs")
    print("tiers     | who          | requests | failed | TTFT p50 | TTFT p90 | cached")
    for setting, by_who in results.items():
        for who, cell in by_who.items():
            print(
                f"{setting:9s} | {who:12s} | {cell['requests']:8.0f} | {cell['failed']:6.0f} "
                f"| {cell['ttft_p50']:7.2f}s | {cell['ttft_p90']:7.2f}s | {cell['cached']:5.0%}"
            )
    if "off" in results:
        off = results["off"]["new replica"]["ttft_p90"]
        for setting in results:
            if setting != "off":
                ratio = results[setting]["new replica"]["ttft_p90"] / off
                print(f"the new replica's TTFT p90, {setting} / off: x{ratio:.2f} (target: at most 0.5)")


if __name__ == "__main__":
    main()
