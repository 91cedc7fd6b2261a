"""Fit a simulated replica's cost model to a real engine's steps on this machine.

    python bench/sim_calibrate.py [--model smollm2-135m-instruct] [--threads 1]

Runs the real engine (as `pagefleet serve` runs it: its defaults) over a grid of batches:
prompts of 64 to 1,536 tokens, 1 to 32 at a time, each then decoding 24 tokens. Every step's
wall time is recorded with the chunks it computed, and the cost model's coefficients
(engine/sim/profiles.py: overhead, per token, per KV token read, per query-key pair) are
fitted by non-negative least squares. Prints the fitted profile, how far the model is from
the measured steps (by step kind), and the total time of the grid measured and modelled:
the ratio is the figure to compare with the 15% the fidelity target allows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np
from common import progress

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.front.llm_engine import LLMEngine
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.sim.cost_model import ChunkShape, step_seconds
from pagefleet.engine.sim.profiles import PROFILES

PROMPTS = (64, 256, 768, 1536)
BATCHES = (1, 4, 16, 32)
DECODE_TOKENS = 24


def record_steps(engine: LLMEngine) -> list[tuple[list[ChunkShape], float]]:
    """Every step's chunks and the wall time of its runner call."""
    steps: list[tuple[list[ChunkShape], float]] = []
    execute = engine.runner.execute

    def timed(plan):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        results = execute(plan)
        steps.append(([ChunkShape(c.start, c.num_new_tokens) for c in plan.chunks], time.perf_counter() - started))
        return results

    engine.runner.execute = timed  # type: ignore[method-assign]
    return steps


def run_grid(engine: LLMEngine) -> None:
    for prompt_tokens in PROMPTS:
        for batch in BATCHES:
            if prompt_tokens * batch > 24_000:
                continue
            progress(f"{batch} prompts of {prompt_tokens} tokens")
            for i in range(batch):
                ids = [((i * 7919 + t * 104729) % 40000) + 100 for t in range(prompt_tokens)]  # no shared prefix
                params = SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True, temperature=0.0)
                engine.add_request(f"{prompt_tokens}-{batch}-{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                engine.step()


def features(shapes: list[ChunkShape]) -> list[float]:
    tokens = sum(s.num_tokens for s in shapes)
    kv = sum(s.start + s.num_tokens for s in shapes)
    pairs = sum(s.num_tokens * s.start + s.num_tokens * (s.num_tokens + 1) // 2 for s in shapes)
    return [1.0, float(tokens), float(kv), float(pairs)]


def is_decode(shapes: list[ChunkShape]) -> bool:
    return all(s.num_tokens == 1 for s in shapes)


def fit(steps: list[tuple[list[ChunkShape], float]]) -> np.ndarray:
    """Non-negative least squares, weighted by 1/time so that short decode steps count as
    much as long prefills (a relative error is what TTFT and ITL feel)."""
    x = np.array([features(shapes) for shapes, _ in steps])
    y = np.array([seconds for _, seconds in steps])
    x, y = x / y[:, None], np.ones_like(y)
    active = list(range(x.shape[1]))
    while True:  # least squares, dropping a negative coefficient at a time (4 unknowns)
        solution, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (solution >= 0).all():
            coefficients = np.zeros(x.shape[1])
            coefficients[active] = solution
            return coefficients
        del active[int(np.argmin(solution))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    engine = LLMEngine(EngineConfig(model=args.model, enable_prefix_caching=False))
    steps = record_steps(engine)
    run_grid(engine)
    overhead, per_token, per_kv, per_pair = fit(steps)
    profile = dataclasses.replace(
        PROFILES["cpu-smollm2"],
        step_overhead_s=float(overhead),
        weights_read_s=0.0,
        token_compute_s=float(per_token),
        kv_read_s=float(per_kv),
        attention_pair_s=float(per_pair),
    )
    print(f"fitted: step_overhead_s={overhead:.3e} token_compute_s={per_token:.3e} "
          f"kv_read_s={per_kv:.3e} attention_pair_s={per_pair:.3e}")  # fmt: skip
    for kind in ("decode", "prefill"):
        chosen = [(shapes, t) for shapes, t in steps if is_decode(shapes) == (kind == "decode")]
        errors = sorted(abs(step_seconds(profile, shapes) / t - 1) for shapes, t in chosen)
        if errors:
            print(f"{kind} steps: {len(errors)}, |model/measured - 1| p50 {errors[len(errors) // 2]:.1%}, "
                  f"p90 {errors[int(len(errors) * 0.9)]:.1%}")  # fmt: skip
    measured = sum(t for _, t in steps)
    modelled = sum(step_seconds(profile, s) for s, _ in steps)
    print(f"grid: {len(steps)} steps, measured {measured:.2f} s, modelled {modelled:.2f} s: {modelled / measured:.3f}x")


if __name__ == "__main__":
    main()
