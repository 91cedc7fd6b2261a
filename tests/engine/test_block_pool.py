"""Block pool scenarios with a tiny pool: ids, ref counts, the prefix index, eviction order."""

from __future__ import annotations

from pagefleet.engine.core.block_pool import BlockPool, KVEvent, take_events


def test_allocate_and_free_return_every_block() -> None:
    pool = BlockPool(8)
    first = pool.try_allocate(5)
    assert first == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 3
    assert pool.try_allocate(4) is None, "an allocation that does not fit changes nothing"
    assert pool.num_free_blocks == 3
    pool.free(first[::-1])
    assert pool.num_free_blocks == 8
    assert all(pool.ref_count(b) == 0 for b in range(8))


def test_shared_block_is_free_only_after_last_reference() -> None:
    pool = BlockPool(4)
    (block,) = pool.try_allocate(1) or []
    pool.incref([block])
    pool.incref([block])
    assert pool.ref_count(block) == 3
    pool.free([block])
    pool.free([block])
    assert pool.num_free_blocks == 3
    pool.free([block])
    assert pool.num_free_blocks == 4


def test_cached_block_survives_free_and_is_revived_by_touch() -> None:
    pool = BlockPool(4)
    (block,) = pool.try_allocate(1) or []
    pool.register(block, 1234, (1, 2, 3, 4))
    pool.free([block])
    assert pool.num_free_blocks == 4, "a cached block with no references counts as free"
    assert pool.try_lookup(1234, (1, 2, 3, 4)) == block
    assert pool.try_lookup(1234, (9, 9, 9, 9)) is None, "a hash collision must not hit"
    pool.touch(block)
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 3


def test_uncached_blocks_are_used_before_any_cached_block_is_evicted() -> None:
    pool = BlockPool(4)
    blocks = pool.try_allocate(2) or []
    for index, block in enumerate(blocks):
        pool.register(block, 100 + index, (index,))
    pool.free(blocks[::-1])  # tail first: block 1 is freed (and so evicted) before block 0
    assert pool.try_allocate(2) == [2, 3], "free uncached blocks go first"
    assert pool.num_cached_blocks == 2
    assert pool.try_allocate(1) == [1], "then the least recently freed cached block"
    assert pool.try_lookup(101, (1,)) is None and pool.try_lookup(100, (0,)) == 0
    assert pool.num_evictions == 1


def test_duplicate_prefix_is_not_registered_twice() -> None:
    pool = BlockPool(4)
    a, b = pool.try_allocate(2) or []
    pool.register(a, 7, (5,))
    pool.register(b, 7, (5,))
    assert pool.num_cached_blocks == 1
    pool.free([b])
    assert pool.try_allocate(3) is not None, "the duplicate is an ordinary free block"


def test_events_report_every_hash_cached_and_forgotten_in_order() -> None:
    pool = BlockPool(3)
    first, second = pool.try_allocate(2) or []
    pool.register(first, 11, (1,))
    pool.enable_events()  # what was cached before is reported first
    pool.register(second, 22, (2,))
    pool.register(second, 33, (3,))  # already registered: nothing changes
    assert pool.events is not None
    assert take_events(pool.events) == [KVEvent(11, True), KVEvent(22, True)]
    (third,) = pool.try_allocate(1) or []
    pool.register(third, 11, (1,))  # another copy of a cached prefix stays unregistered
    pool.free([second, first, third])
    assert take_events(pool.events) == [], "freed blocks stay cached (evictable)"
    assert pool.try_allocate(3) is not None  # evicts both cached blocks, least recently freed first
    assert take_events(pool.events) == [KVEvent(22, False), KVEvent(11, False)]
    assert take_events(pool.events) == [], "each event is taken once"
