"""Prefix-cache block hashes that are the same in every process and on every machine.

The engine keys its prefix cache by these hashes, replicas publish them to the fleet's
index in Redis, and the gateway computes them for a request before it routes it: all three
must agree bit for bit, so there is exactly one definition, here (docs/redis-protocol.md).

    root    = blake2b-64("pagefleet-kv-v1" 0 adapter 0 cache_salt [0 "long-rope"])
    hash[0] = blake2b-64(root    as 8 bytes LE || token ids of block 0 as uint32 LE)
    hash[i] = blake2b-64(hash[i-1] as 8 bytes LE || token ids of block i as uint32 LE)

    state   = blake2b-64("state" || hash[i] as 8 bytes LE)   (`state_snapshot_hash`)

Only full blocks have a hash. The model is not hashed: one engine serves one model, and the
fleet's index is keyed by model. Python's `hash()` is not used anywhere in the chain: it is
salted per process for strings.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

VERSION = b"pagefleet-kv-v1"
HASH_BYTES = 8

_TOKEN_BYTES = 4


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=HASH_BYTES).digest(), "little")


def chain_root(adapter: str | None = None, cache_salt: str | None = None, long_rope: bool = False) -> int:
    """The first link of a request's chain: requests of different LoRA adapters, or with
    different `cache_salt` values (vLLM's request field), never share a block; nor do a
    LongRoPE model's requests whose prompts are longer than its pretraining length, whose
    keys rotate by other frequencies (engine/layers/rotary.py), with shorter ones."""
    parts = [VERSION, (adapter or "").encode(), (cache_salt or "").encode()]
    return _digest(b"\0".join(parts + [b"long-rope"] if long_rope else parts))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: int,
    parents: Sequence[int] = (),
    known: dict[bytes, int] | None = None,
) -> list[int]:
    """The chained hashes of every full block of `token_ids`.

    Args:
        token_ids: the sequence's tokens from its first on.
        block_size: token slots per block.
        root: the chain's first link (`chain_root`).
        parents: hashes already known for the first blocks; they are kept, not recomputed.
        known: digests computed before, by their input (a link's parent and tokens), and
            filled with the new ones: a router hashing the same system prompts request
            after request looks each link up instead (1.17 -> 0.46 ms a b2b-saas request).
    Returns:
        one hash per full block, `parents` first.
    """
    hashes = list(parents)
    num_full = len(token_ids) // block_size
    if len(hashes) >= num_full:
        return hashes[:num_full]
    start = len(hashes) * block_size
    packed = pack_tokens(token_ids[start : num_full * block_size])
    parent = hashes[-1] if hashes else root
    stride = block_size * _TOKEN_BYTES
    for offset in range(0, len(packed), stride):
        link = parent.to_bytes(HASH_BYTES, "little") + packed[offset : offset + stride]
        digest = known.get(link) if known is not None else None
        if digest is None:
            digest = _digest(link)
            if known is not None:
                known[link] = digest
        parent = digest
        hashes.append(parent)
    return hashes


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as the chain hashes them: uint32, little-endian."""
    tokens = array("I", token_ids)
    assert tokens.itemsize == _TOKEN_BYTES, "token ids must pack as uint32"
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tobytes()


def state_snapshot_hash(block_hash: int) -> int:
    """The fleet index's name for the state a model with state layers keeps after the block
    of `block_hash` (a prefix snapshot): such a replica serves a prefix only as far as it
    holds the blocks and the snapshot after the last, so it publishes both, in one SET."""
    return _digest(b"state" + block_hash.to_bytes(HASH_BYTES, "little"))


def pack(hashes: Sequence[int]) -> bytes:
    """Hashes as one byte string (8 bytes each, little-endian), as they are stored in Redis."""
    return b"".join(h.to_bytes(HASH_BYTES, "little") for h in hashes)


def unpack(data: bytes) -> list[int]:
    """The inverse of `pack`."""
    return [int.from_bytes(data[i : i + HASH_BYTES], "little") for i in range(0, len(data), HASH_BYTES)]


def reusable_prefix(token_ids: Sequence[int], block_size: int, root: int) -> tuple[list[int], list[int]]:
    """The tokens of a prompt's full blocks that may come from a cache (all but the block of
    its last token, which is always computed: its logits pick the first output token) and
    their chained hashes."""
    full = list(token_ids[: max(0, len(token_ids) - 1) // block_size * block_size])
    return full, block_hashes(full, block_size, root)
