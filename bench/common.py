"""Shared workload and timing helpers for the benchmarks.

Machines here are noisy and shared: every benchmark measures its baseline in the same run
and reports ratios, never absolute figures alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import random  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402


@dataclass(slots=True, frozen=True)
class Workload:
    prompts: list[list[int]]
    output_tokens: int

    @property
    def total_output_tokens(self) -> int:
        return len(self.prompts) * self.output_tokens


def fixed_workload(
    num_requests: int = 64,
    min_prompt: int = 64,
    max_prompt: int = 512,
    output_tokens: int = 128,
    vocab_size: int = 49152,
    seed: int = 0,
) -> Workload:
    """Prompts of random lengths and random (non-special) token ids, the same every run."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(min_prompt, max_prompt))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, output_tokens)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)
