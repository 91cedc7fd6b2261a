"""Block tables on top of the pool: on-demand allocation, copy-on-write, prefix reuse, swap."""

from __future__ import annotations

from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.request import Request
from pagefleet.engine.sample.sampling_params import SamplingParams


def _request(tokens: list[int], n: int = 1) -> Request:
    return Request("r", None, tokens, SamplingParams(n=n), arrival_index=0, max_tokens=16)


def test_blocks_are_allocated_on_demand_and_only_the_last_is_partial() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    seq = _request(list(range(10))).sequences[0]
    assert manager.allocate_slots(seq, 6)
    assert len(manager.block_table(seq)) == 2  # 6 tokens: one full block, one with 2 of 4 slots
    manager.commit(seq, 6)
    assert manager.allocate_slots(seq, 2)
    assert len(manager.block_table(seq)) == 2, "tokens 7-8 fit the part-filled block"
    manager.commit(seq, 2)
    assert manager.allocate_slots(seq, 1)
    assert len(manager.block_table(seq)) == 3
    manager.free(seq)
    assert manager.num_free_blocks == 8


def test_fork_shares_blocks_and_first_write_copies_the_partial_block() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    request = _request(list(range(6)), n=3)
    parent, *children = request.sequences
    assert manager.allocate_slots(parent, 6)
    manager.commit(parent, 6)
    for child in children:
        manager.fork(parent, child)
    full, partial = manager.block_table(parent)
    assert manager.pool.ref_count(full) == 3 and manager.pool.ref_count(partial) == 3
    assert manager.num_free_blocks == 6, "three sequences, two blocks"

    for seq in request.sequences:
        seq.token_ids.append(99)
        assert manager.allocate_slots(seq, 1)
    copies = manager.pending.take().device
    assert len(copies) == 2, "two of the three sharers copy; the last owns the original"
    assert all(src == partial for src, _ in copies)
    assert len({manager.block_table(seq)[1] for seq in request.sequences}) == 3
    assert manager.pool.ref_count(full) == 3, "the full prompt block stays shared"
    assert manager.stats.cow_copies == 2
    for seq in request.sequences:
        manager.free(seq)
    assert manager.num_free_blocks == 8


def test_prefix_hits_reuse_full_blocks_but_never_the_last_token() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = _request(list(range(8))).sequences[0]
    assert manager.allocate_slots(first, 8)
    manager.commit(first, 8)  # also publishes the full blocks
    first_blocks = list(manager.block_table(first))
    manager.free(first)
    assert manager.pool.num_cached_blocks == 2

    same = _request(list(range(8))).sequences[0]
    hit = manager.find_prefix_hits(same, same.num_tokens)
    assert hit.num_blocks == 1, "the last token is always computed, so only block 0 hits"
    assert hit.cost == 1, "the hit block is evictable, so taking it uses a free block"
    longer = _request(list(range(8)) + [42]).sequences[0]
    hit = manager.find_prefix_hits(longer, longer.num_tokens)
    assert hit.tables == [first_blocks]
    manager.take_cached_prefix(longer, hit)
    assert manager.num_computed_tokens(longer) == 8
    assert manager.stats.prefix_hits == 0  # counted by the scheduler, per request
    manager.free(longer)
    assert manager.num_free_blocks == 8


def test_swap_out_and_in_keeps_sharing() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False, num_host_blocks=6)
    request = _request(list(range(6)), n=2)
    parent, child = request.sequences
    assert manager.allocate_slots(parent, 6)
    manager.commit(parent, 6)
    manager.fork(parent, child)
    assert manager.can_swap_out(request)
    manager.swap_out(request)
    assert len(manager.pending.swap_out) == 2, "shared blocks are copied to the host once"
    assert manager.num_free_blocks == 6 and manager.num_free_host_blocks == 4
    assert manager.swap_in_cost(request) <= manager.num_free_blocks
    manager.swap_in(request)
    assert len(manager.pending.swap_in) == 2
    assert manager.block_table(parent) == manager.block_table(child)
    assert all(manager.pool.ref_count(b) == 2 for b in manager.block_table(parent))
    assert manager.num_free_host_blocks == 6
    manager.free_request(request)
    assert manager.num_free_blocks == 6


def test_a_state_snapshot_is_held_only_once_its_copy_ran_and_never_reused_while_held() -> None:
    """A model with state layers: a prompt's chunk ending on a block boundary keeps its
    state in a snapshot row by a copy that runs before the next step; a connector on another
    thread may hold (and read) the row only after that, and a held row is never evicted
    for another snapshot, even by a prefix-cache reset (it is freed when released)."""
    manager = KVCacheManager(
        num_blocks=16, block_size=4, enable_prefix_caching=True, num_state_slots=2, num_state_snapshots=1
    )
    first, second = _request(list(range(9))).sequences[0], _request(list(range(100, 109))).sequences[0]
    assert manager.allocate_slots(first, 8)
    manager.commit(first, 8)  # ends on the prompt's last boundary before its last token
    copies = manager.pending.take()
    assert len(copies.state) == 1
    (_, row), (block_hash,) = copies.state[0], manager._record(first).block_hashes[1:2]
    assert manager.hold_snapshot(block_hash) is None, "its copy has not run"
    manager.state_copies_ran(copies)
    assert manager.hold_snapshot(block_hash) == row
    assert manager.allocate_slots(second, 8)
    manager.commit(second, 8)  # the only row is held: this snapshot is not kept
    assert manager.pending.take().state == [] and manager.snapshots.num_cached == 1  # type: ignore[union-attr]
    manager.free(first)
    manager.free(second)
    assert manager.reset_prefix_cache() and manager.snapshots.num_cached == 0  # type: ignore[union-attr]
    manager.release_snapshot(row)
    assert manager.snapshots.num_held == 0  # type: ignore[union-attr]
    third = _request(list(range(200, 209))).sequences[0]
    assert manager.allocate_slots(third, 8)
    manager.commit(third, 8)
    assert manager.pending.take().state[0][1] == row, "the released row is free again"
