"""Time to first token of a long prompt by where its KV comes from: computed, a local prefix
hit, or the file tier (page cache warm and cold); and the prompt length below which reading
the file tier stops paying, measured and as the cost model decides.

    python bench/kv_tiers.py [--tokens 2000] [--repeats 3] [--threads 2]

SmolLM2-135M-Instruct in float32 at pagefleet's defaults (block size 16), one engine per
role in this process: engine A computes a random prompt of `--tokens` tokens with an
empty file tier (cold), then again (a local hit); engine B, a new replica on the same
directory, reads it from the files with the page cache warm, then with the files dropped
from the page cache (`posix_fadvise(DONTNEED)`), its prefix cache emptied before each
read. TTFT is the wall time of a one-token `generate` (the read happens inside it). Each
figure is the median of `--repeats`; every answer is checked token for token against the
computed one. Target (issue 35): the file tier at most 0.25x of recomputing.

The crossover: for prompts of 1..16 blocks, recomputing against reading every full block
from the files (the cost model bypassed), and the shortest prompt the cost model reads.

Peer pull: two `pagefleet serve` replicas; the reader gets a prompt the holder computed,
with the gateway's hint naming the holder, and pulls its prefix over HTTP (its cost model
deciding), against the reader computing a new prompt of the same length.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import progress

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.kv_connector.file_tier import FileTierConnector

MODEL = "smollm2-135m-instruct"
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
CHECK = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def ttft(llm: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN)
    return time.perf_counter() - started


def answer(llm: LLM, prompt: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt}], CHECK)[0].outputs[0].token_ids


def drop_page_cache(directory: Path) -> None:
    """Ask the kernel to forget the files' pages (clean pages of our own files: no root)."""
    for path in directory.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def median_of(repeats: int, measure) -> float:  # type: ignore[no-untyped-def]
    return statistics.median(measure() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-only", action="store_true", help="only the peer pull")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    rng = random.Random(0)
    if args.peer_only:
        peer_pull([[rng.randrange(100, 49000) for _ in range(args.tokens)]], args.repeats, args.threads)
        return
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder)
        progress(f"engine A: a {args.tokens}-token prompt computed, then a local hit")
        computer = LLM(MODEL, dtype="float32", kv_cache_dir=folder)
        prompts = [[rng.randrange(100, 49000) for _ in range(args.tokens)] for _ in range(args.repeats)]
        ttft(computer, prompts[0][:64])  # warm up
        cold = statistics.median(ttft(computer, prompt) for prompt in prompts)
        local = median_of(args.repeats, lambda: ttft(computer, prompts[0]))
        expected = answer(computer, prompts[0])

        progress("engine B (a new replica on the same directory): the file tier, page cache warm then cold")
        reader = LLM(MODEL, dtype="float32", kv_cache_dir=folder)
        ttft(reader, prompts[1][:8])  # warm up (too short to read anything)

        def from_files(drop: bool) -> float:
            if drop:
                drop_page_cache(directory)
            return fresh_ttft(reader, prompts[0])

        warm = median_of(args.repeats, lambda: from_files(False))
        cold_files = median_of(args.repeats, lambda: from_files(True))
        reader.engine.reset_prefix_cache()
        same = answer(reader, prompts[0]) == expected
        tier = reader.stats().kv_tier
        assert tier is not None

        print(f"TTFT of a {args.tokens}-token prompt (median of {args.repeats}):")
        for name, seconds in (
            ("computed", cold),
            ("local prefix hit", local),
            ("file tier, page cache warm", warm),
            ("file tier, page cache cold", cold_files),
        ):
            print(f"  {name:28s} {seconds * 1000:8.1f} ms   x{seconds / cold:.3f} of computed")
        print(f"  tokens equal to the computed answer: {same}; bad files: {tier.bad_files}")

        progress("crossover: short prompts computed vs read from the files")
        connector = reader.engine.kv_connector.member(FileTierConnector)
        assert connector is not None
        tier_obj = connector.tier
        block = reader.engine.kv_cache.block_size
        plain = LLM(MODEL, dtype="float32")  # no file tier: always computes
        ttft(plain, prompts[1][:64])
        print("blocks | computed ms | read ms | faster")
        for blocks in (1, 2, 4, 8, 16):
            prompt = [rng.randrange(100, 49000) for _ in range(blocks * block + 1)]
            computed_s = median_of(args.repeats, lambda p=prompt: fresh_ttft(plain, p))
            ttft(computer, prompt)  # written to the files
            saved = tier_obj.cost.seconds_per_block
            tier_obj.cost.seconds_per_block = 0.0  # always read: what reading really costs
            read_s = median_of(args.repeats, lambda p=prompt: fresh_ttft(reader, p))
            tier_obj.cost.seconds_per_block = saved
            faster = "read" if read_s < computed_s else "compute"
            print(f"{blocks:6d} | {computed_s * 1000:11.1f} | {read_s * 1000:7.1f} | {faster}")
        cost = tier_obj.cost
        print(f"the cost model reads prefixes of {cost.crossover_tokens(block)} tokens and more", end=" ")
        print(
            f"(prefill {cost.prefill_tokens_per_s:.0f} tokens/s, {cost.seconds_per_block * 1000:.2f} ms per block read)"
        )
    peer_pull(prompts, args.repeats, args.threads)


def peer_pull(prompts: list[list[int]], repeats: int, threads: int) -> None:
    """Two `pagefleet serve` replicas at their defaults: the holder computes each prompt; the
    reader then gets it with the gateway's hint naming the holder (`x-pagefleet-kv-peer`)
    and pulls the prefix if its cost model says so. Against the reader computing prompts of
    the same length no replica has seen. TTFT over HTTP (one-token completions)."""
    import httpx
    from serve import start_server

    progress("peer pull: two pagefleet serve replicas, the reader pulling from the holder")
    holder, holder_url = start_server(threads)
    reader, reader_url = start_server(threads)
    try:
        rng = random.Random(1)
        length = len(prompts[0])

        def first_token(url: str, prompt: list[int], peer: str | None = None) -> tuple[float, int]:
            headers = {"x-pagefleet-kv-peer": peer} if peer else {}
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            started = time.perf_counter()
            answer = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120).json()
            cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            return time.perf_counter() - started, cached

        first_token(reader_url, prompts[0][:64])  # warm up; measures its prefill speed
        computed, pulled, cached = [], [], []
        for _ in range(repeats):
            computed.append(first_token(reader_url, [rng.randrange(100, 49000) for _ in range(length)])[0])
            prompt = [rng.randrange(100, 49000) for _ in range(length)]
            first_token(holder_url, prompt)
            seconds, tokens = first_token(reader_url, prompt, holder_url)
            pulled.append(seconds)
            cached.append(tokens)
        ours, theirs = statistics.median(pulled), statistics.median(computed)
        print(f"peer pull over HTTP, {length} tokens (median of {repeats}):")
        print(f"  computed by the reader       {theirs * 1000:8.1f} ms")
        print(f"  pulled from the holder       {ours * 1000:8.1f} ms   x{ours / theirs:.3f} of computed")
        print(f"  cached tokens per pull: {cached}")
    finally:
        for process in (reader, holder):
            process.terminate()
            process.wait(timeout=30)


def fresh_ttft(llm: LLM, prompt: list[int]) -> float:
    """TTFT with the engine's own prefix cache emptied first."""
    llm.engine.reset_prefix_cache()
    return ttft(llm, prompt)


if __name__ == "__main__":
    main()
