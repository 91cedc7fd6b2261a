"""What a replica reports about itself: `EngineStats`, read by the server's /metrics and the
Redis publisher (see docs/redis-protocol.md), with the types of its parts, and the
prefix-cache events `AsyncEngine.take_kv_events` gives (`KVEvent`): the engine's public
figures, so its server needs no module of the engine's internals."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagefleet.engine.core.block_pool import KVEvent
from pagefleet.engine.kv_tiers.file_tier import TierStats
from pagefleet.engine.spec_decode.speculator import SpecDecodeStats

__all__ = ["EngineStats", "KVEvent", "SpecDecodeStats", "TierStats"]


@dataclass(slots=True, frozen=True)
class EngineStats:
    """What a replica reports to the fleet (and what /metrics exports)."""

    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    block_size: int
    num_running_requests: int
    num_waiting_requests: int
    num_swapped_requests: int
    num_preemptions_recompute: int
    num_preemptions_swap: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_cow_copies: int
    num_shared_blocks: int  # blocks referenced by more than one sequence
    num_blocks_saved_by_sharing: int  # copies that sharing avoids right now
    peak_used_blocks: int  # most blocks ever in use at once
    num_prompt_tokens: int
    num_generation_tokens: int
    # The longest context a new request could be admitted with now, in every KV cache group
    # (a sliding-window group needs only its window's blocks).
    num_free_tokens: int = 0
    num_waiting_prompt_tokens: int = 0  # uncached prompt tokens of queued requests (prefill pressure)
    num_pinned_blocks: int = 0  # blocks of finished prompts waiting for a decode replica's pull
    num_pinned_requests: int = 0
    num_pin_timeouts: int = 0  # pinned prompts freed because nobody pulled them in time
    prefill_tokens_per_s: float = 0.0  # prompt tokens computed per second, a moving average
    # A model with state layers: its state cache's slots (one per running sequence), those
    # free now, and the snapshots its prefix cache keeps; zeros for other models.
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    num_state_snapshots: int = 0
    kv_tier: TierStats | None = None  # the file tier's counters, if it is on
    spec_decode: SpecDecodeStats | None = None  # speculation's counters, if it is on

    def since(self, earlier: EngineStats) -> EngineStats:
        """These stats with the request counters counted from `earlier` (a server's warm-up
        request is no request of its clients')."""
        return replace(
            self,
            num_preemptions_recompute=self.num_preemptions_recompute - earlier.num_preemptions_recompute,
            num_preemptions_swap=self.num_preemptions_swap - earlier.num_preemptions_swap,
            prefix_cache_queries=self.prefix_cache_queries - earlier.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - earlier.prefix_cache_hits,
            num_prompt_tokens=self.num_prompt_tokens - earlier.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens - earlier.num_generation_tokens,
        )

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks
