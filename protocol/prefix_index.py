"""The fleet's prefix index in Redis: which replica holds which prefix-cache block.

Each replica keeps, per served (base) model:
- `pagefleet:kv:<model>:<replica_id>`: a SET of the block hashes (protocol/block_hash.py,
  8 bytes each) of every full block in its prefix cache now, in use or evictable. It expires
  with the replica's record (same TTL, refreshed with it), so a dead replica leaves nothing
  behind for long; it is the snapshot a router reads when it starts.
- `pagefleet:kv-events:<model>`: a STREAM of changes, one entry per batch and replica, with
  fields `replica` (its id), `stored` and `removed` (packed hashes) and `reset` ("1": forget
  everything this replica held before this entry, sent when it starts, after it lost Redis,
  and when it leaves). Capped at about `STREAM_MAX_ENTRIES` entries, so memory is bounded.

A router applies the stream in order on top of the snapshots it read (entries set a hash's
presence absolutely, so replaying an entry the snapshot already holds is harmless). Entries
of a replica without a live record are ignored. See docs/redis-protocol.md.
"""

from __future__ import annotations

INDEX_PREFIX = "pagefleet:kv:"
EVENTS_PREFIX = "pagefleet:kv-events:"
STREAM_MAX_ENTRIES = 10_000


def blocks_key(model: str, replica_id: str) -> str:
    return f"{INDEX_PREFIX}{model}:{replica_id}"


def events_key(model: str) -> str:
    return f"{EVENTS_PREFIX}{model}"
