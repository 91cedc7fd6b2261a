"""How long a step takes on a profile's hardware (profiles.py's formula), from what the
scheduler planned: each chunk's new tokens and the context before them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagefleet.engine.sim.profiles import SimProfile


@dataclass(frozen=True, slots=True)
class ChunkShape:
    """A chunk of one sequence: `start` tokens already in its KV, `num_tokens` computed now."""

    start: int
    num_tokens: int


def step_seconds(profile: SimProfile, chunks: Iterable[ChunkShape], swapped_blocks: int = 0) -> float:
    """The profile's time for a step computing `chunks` and copying `swapped_blocks` blocks
    between device and host (0.0 for an empty step)."""
    tokens, attention = 0, 0.0
    for chunk in chunks:
        n, end = chunk.num_tokens, chunk.start + chunk.num_tokens
        tokens += n
        pairs = n * chunk.start + n * (n + 1) // 2  # causal: each new token sees those before it
        attention += end * profile.kv_read_s + pairs * profile.attention_pair_s
    if tokens == 0 and swapped_blocks == 0:
        return 0.0
    linear = max(profile.weights_read_s, tokens * profile.token_compute_s) if tokens else 0.0
    return profile.step_overhead_s + linear + attention + swapped_blocks * profile.swap_block_s
