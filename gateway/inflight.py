"""What this router has sent to each replica that the replica has not reported yet.

Replicas report every half second; a burst between two reports would all see the same
figures and pile onto one replica. So the router counts, per replica, the KV blocks and
uncached prompt tokens of the requests it sent since that replica's last report (the
report that follows includes them, so they are dropped then), and remembers for a few
seconds which prefixes it sent where: a prompt's blocks reach the fleet's index only after
the replica computed them, and a second request with the same new prefix that arrives
meanwhile should still follow the first.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagefleet.protocol.replica import ReplicaRecord

PENDING_PREFIX_S = 10.0  # longer than a prompt waits in a queue that is not saturated
_REPORT_MARGIN_S = 0.1  # a report this soon after a send may not include it yet


@dataclass(slots=True)
class Sent:
    replica_id: str
    sent_at: float  # Unix time, comparable with a report's timestamp
    blocks: int
    prompt_tokens: int


class InFlight:
    """`clock`: Unix time, comparable with reports' timestamps (bench/fleet_sim.py passes a
    simulated one)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._sent: dict[str, list[Sent]] = {}  # replica id -> sends not yet reported
        self._prefixes: dict[int, dict[str, float]] = {}  # block hash -> replica id -> expiry
        self._expiries: deque[tuple[float, str, list[int]]] = deque()

    def record(self, replica: ReplicaRecord, blocks: int, prompt_tokens: int, block_hashes: list[int]) -> Sent:
        """Count a request sent to `replica`; the result is what `cancel` takes."""
        now = self.clock()
        sent = Sent(replica.replica_id, now, blocks, prompt_tokens)
        self._sent.setdefault(replica.replica_id, []).append(sent)
        if block_hashes:
            expiry = now + PENDING_PREFIX_S
            for block_hash in block_hashes:
                self._prefixes.setdefault(block_hash, {})[replica.replica_id] = expiry
            self._expiries.append((expiry, replica.replica_id, block_hashes))
        return sent

    def cancel(self, sent: Sent) -> None:
        """The replica failed the request: it takes none of it."""
        pending = self._sent.get(sent.replica_id, [])
        if sent in pending:
            pending.remove(sent)

    def promised(self, replica: ReplicaRecord) -> tuple[int, int]:
        """(blocks, uncached prompt tokens) sent to the replica since its last report."""
        pending = self._sent.get(replica.replica_id)
        if not pending:
            return 0, 0
        reported = replica.timestamp - _REPORT_MARGIN_S
        pending[:] = [sent for sent in pending if sent.sent_at > reported]
        return sum(s.blocks for s in pending), sum(s.prompt_tokens for s in pending)

    def matched_blocks(self, block_hashes: list[int], replica_ids: list[str]) -> dict[str, int]:
        """Per replica, how many leading `block_hashes` this router sent it lately."""
        self._expire()
        matched = dict.fromkeys(replica_ids, 0)
        alive = set(replica_ids)
        for depth, block_hash in enumerate(block_hashes, start=1):
            alive &= self._prefixes.get(block_hash, {}).keys()
            if not alive:
                break
            for replica_id in alive:
                matched[replica_id] = depth
        return matched

    def _expire(self) -> None:
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            expiry, replica_id, block_hashes = self._expiries.popleft()
            for block_hash in block_hashes:
                holders = self._prefixes.get(block_hash)
                if holders is not None and holders.get(replica_id) == expiry:
                    del holders[replica_id]
                    if not holders:
                        del self._prefixes[block_hash]
