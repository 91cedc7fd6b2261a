"""The default routing policy, `affinity`: the request's prompt hashed exactly as the engine
will hash it (prompt_hashes.py), looked up in the fleet's prefix index (prefix_index.py) and
in what this router sent lately (inflight.py), then one pure decision (decision.py).

Tokenizing costs gateway CPU, so it is done only when more than one replica could serve
the request. Without a tokenizer yet, with Redis down or the index empty, every replica
holds nothing of the prompt and the decision is by load: never an error for that alone.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict

from pagefleet.gateway.decision import Candidate, decide
from pagefleet.gateway.inflight import InFlight, Sent
from pagefleet.gateway.metrics import GatewayMetrics
from pagefleet.gateway.prefix_index import PrefixIndex
from pagefleet.gateway.prompt_hashes import PromptHashers
from pagefleet.gateway.route import Route, RoutedRequest
from pagefleet.gateway.shape import RequestShape
from pagefleet.protocol.replica import ReplicaRecord

logger = logging.getLogger(__name__)

_SESSIONS_KEPT = 100_000


class AffinityPolicy:
    """Args:
    hashers, index: the request's block hashes, and who holds them.
    metrics: decisions by reason, predicted cached tokens.
    saturation_s: decision.decide's threshold.
    """

    name = "affinity"

    def __init__(
        self,
        hashers: PromptHashers,
        index: PrefixIndex,
        metrics: GatewayMetrics,
        saturation_s: float,
    ) -> None:
        self.hashers, self.index, self.metrics = hashers, index, metrics
        self.saturation_s = saturation_s
        self.inflight = InFlight()
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session -> replica id it went to

    async def choose(self, candidates: list[ReplicaRecord], request: RoutedRequest) -> Route | None:
        if not candidates:
            return None
        shape, base = request.shape, candidates[0].model
        prompt_tokens, block_hashes = self._hash(shape, candidates)
        replica_ids = [r.replica_id for r in candidates]
        with_state = frozenset(r.replica_id for r in candidates if r.total_state_slots is not None)
        cached = self.index.matched_blocks(base, block_hashes, replica_ids, with_state)
        sent_lately = self.inflight.matched_blocks(block_hashes, replica_ids, with_state)
        views = [
            Candidate(r, max(cached[r.replica_id], sent_lately[r.replica_id]), *self.inflight.promised(r))
            for r in candidates
        ]
        session_replica = self._sessions.get(shape.session) if shape.session else None
        decision = decide(views, prompt_tokens, self.saturation_s, session_replica)
        cached_tokens = decision.cached_blocks * decision.replica.block_size
        blocks = max(0, request.estimated_blocks - decision.cached_blocks)
        sent = self.inflight.record(decision.replica, blocks, max(0, prompt_tokens - cached_tokens), block_hashes)
        if shape.session:
            self._remember_session(shape.session, decision.replica.replica_id)
        if logger.isEnabledFor(logging.DEBUG):  # the per-replica figures cost 0.1 ms at 128 replicas
            logger.debug(
                "routed to %s (%s): %d prompt tokens; per replica, cached blocks and queued prompt tokens %s",
                decision.replica.replica_id,
                decision.reason,
                prompt_tokens,
                {c.replica.replica_id: (c.cached_blocks, c.queued_prompt_tokens) for c in views},
            )
        self.metrics.routing_reasons.labels(shape.model, decision.reason).inc()
        self.metrics.predicted_cached_tokens.labels(shape.model).inc(cached_tokens)
        self.metrics.prefix_index_blocks.labels(base).set(self.index.num_blocks(base))
        cancel = functools.partial(self._cancel, sent)
        peer = decision.holder.url if decision.holder is not None else None
        return Route(
            decision.replica, cancel, blocks, fallbacks=decision.fallbacks, reason=decision.reason, kv_peer=peer
        )

    def _hash(self, shape: RequestShape, candidates: list[ReplicaRecord]) -> tuple[int, list[int]]:
        """The prompt's length and block hashes; no hashes (and the shape's estimate) with a
        single candidate, before the model's tokenizer has arrived, or for a body the
        replica will refuse."""
        base = candidates[0].model
        hasher = self.hashers.try_get(base, candidates[0].url) if len(candidates) > 1 else None
        if hasher is None:
            return shape.prompt_tokens, []
        try:
            hashed = hasher.hashes(shape.payload, shape.chat, shape.model if shape.model != base else None)
        except (ValueError, TypeError, OverflowError) as error:
            logger.debug("cannot hash a request's prompt (%s); routing it by load", error)
            hashed = None
        return hashed if hashed is not None else (shape.prompt_tokens, [])

    async def _cancel(self, sent: Sent) -> None:
        self.inflight.cancel(sent)

    def _remember_session(self, session: str, replica_id: str) -> None:
        self._sessions[session] = replica_id
        self._sessions.move_to_end(session)
        if len(self._sessions) > _SESSIONS_KEPT:
            self._sessions.popitem(last=False)
