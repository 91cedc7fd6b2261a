"""Whether reading a prefix's KV from a tier beats computing it, from figures this replica
measures: its own prefill speed and the tier's read time per block.

Reading n blocks is estimated at `lookup_s + n * seconds_per_block`; recomputing the same
tokens at `tokens / prefill_tokens_per_s`. Both are moving averages of what the engine and
the tier observed (until the first observations, defaults that suit a CPU). A read is
taken only if it is estimated faster, so no path is slower than recomputing, and a
prefix short enough that the fixed cost of a lookup dominates is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable

DEFAULT_PREFILL_TOKENS_PER_S = 1000.0  # until this replica has measured its own
LOOKUP_S = 0.002  # a file read's fixed cost: the thread hop, opening files, the load into blocks
_WEIGHT = 0.2  # of a new observation in the running average


class TierCost:
    """`prefill_tokens_per_s` reads the engine's own moving average (0 until measured);
    `seconds_per_block` is written by the tier's readers (`observe_read`). Floats: any
    thread may read them."""

    def __init__(
        self, prefill_tokens_per_s: Callable[[], float], seconds_per_block: float = 0.002, lookup_s: float = LOOKUP_S
    ) -> None:
        self._prefill_tokens_per_s = prefill_tokens_per_s
        self.seconds_per_block = seconds_per_block
        self.lookup_s = lookup_s

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill_tokens_per_s() or DEFAULT_PREFILL_TOKENS_PER_S

    def observe_read(self, blocks: int, seconds: float) -> None:
        if blocks > 0 and seconds > 0:
            self.seconds_per_block += _WEIGHT * (seconds / blocks - self.seconds_per_block)

    def read_seconds(self, blocks: int) -> float:
        return self.lookup_s + blocks * self.seconds_per_block

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def worth_reading(self, blocks_read: int, tokens_saved: int) -> bool:
        """Whether reading `blocks_read` blocks beats computing `tokens_saved` tokens."""
        return tokens_saved > 0 and self.read_seconds(blocks_read) < self.recompute_seconds(tokens_saved)

    def crossover_tokens(self, block_size: int) -> int:
        """The shortest prefix (whole blocks) that is read rather than recomputed now."""
        blocks = 1
        while not self.worth_reading(blocks, blocks * block_size) and blocks < 1 << 16:
            blocks += 1
        return blocks * block_size
