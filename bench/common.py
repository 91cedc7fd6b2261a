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


def free_port_range(count: int) -> int:
    """The first of `count` consecutive free ports, below Linux's ephemeral range (32768 up),
    so that no `free_port()` taken later can fall inside it."""
    import random
    import socket

    for _ in range(100):
        base = random.randrange(20000, 32768 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise SystemExit(f"no {count} consecutive free ports below 32768")


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)
