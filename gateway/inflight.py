"""What this router has sent to each replica that the replica has not reported yet.

Replicas report every half second; a burst between two reports would all see the same
figures and pile onto one replica. So the router counts, per replica, the KV blocks and
uncached prompt tokens of the requests it sent since that replica's last report (the
report that follows includes them, so they are dropped then), and remembers for a few
seconds which prefixes it sent where: a prompt's blocks reach the fleet's index only after
the replica computed them, and a second request with the same new prefix that arrives
meanwhile should still follow the first.

A replica of a model with state layers can resume a prompt only where it keeps a state
snapshot (engine/core/state_snapshots.py): surely after the prompt's last block boundary
before its last token, which is the last of the block hashes the router computes. So for
such a replica a prefix it was sent counts only up to the deepest sent prompt end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagefleet.gateway.prefix_index import leading_depths
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
        self._prompt_ends: dict[int, dict[str, float]] = {}  # the last block hash of a prompt sent
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
            self._prompt_ends.setdefault(block_hashes[-1], {})[replica.replica_id] = expiry
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

    def matched_blocks(
        self, block_hashes: list[int], replica_ids: list[str], with_state: frozenset[str] = frozenset()
    ) -> dict[str, int]:
        """Per replica, how many leading `block_hashes` this router sent it lately; for the
        replicas of a model with state layers (`with_state`), only as far as a prompt sent
        there ended (where it will keep a state snapshot)."""
        self._expire()
        matched = leading_depths(block_hashes, replica_ids, self._prefixes)
        for replica_id in with_state & matched.keys():
            depth = matched[replica_id]
            while depth and replica_id not in self._prompt_ends.get(block_hashes[depth - 1], {}):
                depth -= 1
            matched[replica_id] = depth
        return matched

    def _expire(self) -> None:
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            expiry, replica_id, block_hashes = self._expiries.popleft()
            for block_hash in block_hashes:
                _drop(self._prefixes, block_hash, replica_id, expiry)
            _drop(self._prompt_ends, block_hashes[-1], replica_id, expiry)


def _drop(entries: dict[int, dict[str, float]], block_hash: int, replica_id: str, expiry: float) -> None:
    """Forget that `replica_id` was sent `block_hash` unless a later send renewed it."""
    holders = entries.get(block_hash)
    if holders is not None and holders.get(replica_id) == expiry:
        del holders[replica_id]
        if not holders:
            del entries[block_hash]
