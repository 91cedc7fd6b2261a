"""The KV connector interface (see the package docstring), with no-op defaults, so a
connector implements only the points it acts at.

Every scheduler-side method runs on the engine thread, between or inside steps; the
connector's state is its own (its one writer), and the scheduler's requests are only read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagefleet.engine.core.kv_cache_manager import FullBlock, KeptSnapshot
from pagefleet.engine.core.request import Request
from pagefleet.engine.kv_transfer.params import RemoteKV


@dataclass(slots=True)
class ConnectorStats:
    """What the connectors report in `EngineStats` (each fills its own fields)."""

    num_pinned_blocks: int = 0
    num_pinned_requests: int = 0
    num_pin_timeouts: int = 0
    kv_tier: Any = None  # the file tier's TierStats, when it is on


class KVConnector:
    """A source or sink of KV blocks outside the forward pass."""

    # --- scheduler side: a request's life (engine thread) --------------------------------

    def request_added(self, request: Request, given: RemoteKV | None) -> None:
        """`request` entered the engine; `given`: KV its caller fetched for it (a pulled
        prompt or prefix), which a connector of that origin keeps until it is loaded."""

    def external_prefix(self, request: Request, num_local_tokens: int) -> RemoteKV | None:
        """The KV of the request's first tokens this connector can supply now, if it covers
        more than the `num_local_tokens` the local prefix cache has (a prefill replica's
        always wins); None otherwise."""
        return None

    def is_loading(self, request: Request) -> bool:
        """Whether KV for `request` is still on its way (the scheduler waits for it)."""
        return False

    def wait_for_load(self, request: Request, timeout: float) -> None:
        """Block until the KV on its way for `request` came, or `timeout` seconds (an
        engine with nothing else to run)."""

    def request_finished(self, request: Request, prompt_blocks: list[list[int]]) -> dict[str, Any] | None:
        """`request` finished (`prompt_blocks`: per KV cache group, the blocks of its computed
        prompt, `NULL_BLOCK` where a sliding group freed them; or []). A connector that
        keeps them takes its own reference and returns the `kv_transfer_params` that say
        how to fetch them."""
        return None

    def drop_staged(self, request: Request) -> None:
        """Forget the KV kept for `request`: the scheduler loaded it (once: a recompute
        preemption computes the prompt here), another connector's or the local cache's
        was taken instead, or the request ended. (What `request_finished` kept stays.)"""

    # --- scheduler side: the steps (engine thread) ----------------------------------------

    def blocks_filled(self, blocks: list[FullBlock]) -> None:
        """The blocks a step made full (and registered in the prefix cache): a saving
        connector takes references on those it will copy out."""

    def snapshots_kept(self, snapshots: list[KeptSnapshot]) -> None:
        """A model with state layers: the state snapshots a step's copies made (each held
        for this connector, which releases it through the KV cache once copied out)."""

    @property
    def wants_filled_blocks(self) -> bool:
        return False

    def between_steps(self, wait: bool = False) -> bool:
        """Housekeeping before a step or while idle (expired pins, finished saves); `wait`:
        until every save is done. True while work is pending."""
        return False

    def fill_stats(self, stats: ConnectorStats) -> None:
        """Write this connector's figures into `stats`."""

    def close(self) -> None:
        """Stop background work (the engine is shutting down)."""
