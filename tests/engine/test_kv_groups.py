"""KV cache groups: layers grouped by window on one block pool, sliding groups keeping only
the blocks a query can still see (exact block counts), prefix hits through a sliding group,
swapping and forking with groups, and the free-token count a replica publishes."""

from __future__ import annotations

from pathlib import Path

import torch

from pagefleet.engine import LLM
from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.kv_groups import NULL_BLOCK, KVGroups
from pagefleet.engine.core.request import Request
from pagefleet.engine.front.request_checks import worst_case_blocks
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.worker.model_runner import kv_bytes_per_block
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, random_prompts

BLOCK = 4
WINDOW = 6  # a query at position p sees p - 5 .. p: at most 3 blocks of 4
# Gemma 3's pattern at a small scale: five sliding layers for each global one.
GEMMA_LIKE = KVGroups.of([WINDOW] * 5 + [None] + [WINDOW] * 5 + [None])


def _request(tokens: list[int], n: int = 1) -> Request:
    return Request("r", None, tokens, SamplingParams(n=n), arrival_index=0, max_tokens=16)


def _run(manager: KVCacheManager, seq, num_tokens: int) -> None:  # type: ignore[no-untyped-def]
    assert manager.allocate_slots(seq, num_tokens) is not None
    manager.commit(seq, num_tokens)


def test_layers_are_grouped_by_window_with_equal_sizes_and_shared_tensors() -> None:
    assert GEMMA_LIKE.windows == (None, WINDOW, WINDOW, WINDOW, WINDOW, WINDOW)
    assert GEMMA_LIKE.num_tensors == 2, "two global layers: groups of two layers each"
    assert GEMMA_LIKE.layer_groups[5] == GEMMA_LIKE.layer_groups[11] == 0
    assert GEMMA_LIKE.layer_tensors[5] == 0 and GEMMA_LIKE.layer_tensors[11] == 1
    # Every (group, tensor) pair is used by exactly one layer: no two layers write the same block.
    pairs = set(zip(GEMMA_LIKE.layer_groups, GEMMA_LIKE.layer_tensors, strict=True))
    assert len(pairs) == GEMMA_LIKE.num_layers
    assert KVGroups.of([None] * 4).num_groups == 1
    assert KVGroups.of([8] * 4).windows == (8,), "Mistral: one sliding group of every layer"
    assert KVGroups.of([WINDOW, None], hybrid=False).windows == (None,)


def test_a_sliding_group_frees_the_blocks_behind_its_window() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK, enable_prefix_caching=False, groups=GEMMA_LIKE)
    seq = _request(list(range(40))).sequences[0]
    _run(manager, seq, 8)  # positions 0-7: two blocks in each of the six groups
    assert manager.num_free_blocks == 64 - 12
    # The next query (position 8) sees 3..8: block 0 (positions 0-3) is still needed.
    assert all(NULL_BLOCK not in table for table in manager.block_tables(seq))
    _run(manager, seq, 2)  # the next query sits at 10 and sees 5..10: block 0 falls behind
    full, *sliding = manager.block_tables(seq)
    assert len(full) == 3 and NULL_BLOCK not in full
    assert all(table[0] == NULL_BLOCK and len(table) == 3 for table in sliding)
    assert manager.num_free_blocks == 64 - 3 - 5 * 2
    for _ in range(20):  # decode to 30 tokens: each sliding group holds at most 3 blocks
        _run(manager, seq, 1)
    full, *sliding = manager.block_tables(seq)
    assert len(full) == 8
    assert all(sum(b != NULL_BLOCK for b in table) <= 3 for table in sliding)
    held = 64 - manager.num_free_blocks
    assert held == 8 + sum(sum(b != NULL_BLOCK for b in table) for table in sliding)
    manager.free(seq)
    assert manager.num_free_blocks == 64


def test_a_prefix_hit_needs_each_sliding_group_s_window_blocks() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BLOCK, enable_prefix_caching=True, groups=GEMMA_LIKE)
    prompt = list(range(100, 124))  # 24 tokens, 6 blocks
    first = _request(prompt).sequences[0]
    _run(manager, first, 24)
    manager.free(first)
    again = _request(prompt + [7]).sequences[0]
    hit = manager.find_prefix_hits(again, again.num_tokens)
    assert hit.num_blocks == 6
    # The first query to compute sits at 24 and sees 19..24: sliding groups need blocks 4 and 5.
    full, *sliding = hit.tables
    assert len(full) == 6 and NULL_BLOCK not in full
    assert all(table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in table[4:] for table in sliding)
    manager.take_cached_prefix(again, hit)
    assert manager.num_computed_tokens(again) == 24
    manager.free(again)
    assert manager.num_free_blocks == 64


def test_a_hit_stops_where_a_sliding_group_lost_its_window() -> None:
    # 36 blocks: the prompt's 6 in each group, so every one ends up cached and evictable.
    manager = KVCacheManager(num_blocks=36, block_size=BLOCK, enable_prefix_caching=True, groups=GEMMA_LIKE)
    prompt = list(range(200, 224))
    first = _request(prompt).sequences[0]
    for _ in range(24):  # one token a step: the sliding groups free their early blocks as they go
        _run(manager, first, 1)
    manager.free(first)
    # Every sliding group's block 4 is the next to be evicted.
    for group in range(1, GEMMA_LIKE.num_groups):
        block = manager.pool.try_lookup(_hash_of(manager, first, prompt, 4), tuple(prompt[16:20]), group)
        assert block is not None
        manager.pool._evictable.move_to_end(block, last=False)  # the next allocation takes it
    taken = manager.pool.try_allocate(5)
    assert taken is not None
    again = _request(prompt + [7]).sequences[0]
    hit = manager.find_prefix_hits(again, again.num_tokens)
    # A hit of 6 blocks needs blocks 4-5 of the sliding groups, of 5 blocks 3-4, of 4 blocks 2-3.
    assert hit.num_blocks == 4
    manager.pool.free(taken)


def _hash_of(manager: KVCacheManager, seq, prompt: list[int], index: int) -> int:  # type: ignore[no-untyped-def]
    from pagefleet.protocol.block_hash import block_hashes

    return block_hashes(prompt[: (index + 1) * BLOCK], BLOCK, seq.hash_root, [])[index]


def test_swap_and_fork_carry_every_group() -> None:
    manager = KVCacheManager(
        num_blocks=64, block_size=BLOCK, enable_prefix_caching=False, num_host_blocks=64, groups=GEMMA_LIKE
    )
    request = _request(list(range(30)), n=2)
    parent, child = request.sequences
    _run(manager, parent, 14)
    held = 64 - manager.num_free_blocks  # full group: 4 blocks; sliding: blocks 2-3 each
    assert held == 4 + 5 * 2
    manager.fork(parent, child)
    assert manager.block_tables(child) == manager.block_tables(parent)
    assert 64 - manager.num_free_blocks == held, "forking copies no block"
    manager.swap_out(request)
    assert manager.num_free_blocks == 64 and manager.num_free_host_blocks == 64 - held
    assert manager.swap_in_cost(request) == held
    manager.swap_in(request)
    assert 64 - manager.num_free_blocks == held
    tables = manager.block_tables(parent)
    assert manager.block_tables(child) == tables and all(t[:2] == [NULL_BLOCK] * 2 for t in tables[1:])
    manager.free_request(request)
    assert manager.num_free_blocks == 64


def test_free_tokens_count_what_a_new_request_can_still_take() -> None:
    manager = KVCacheManager(num_blocks=40, block_size=BLOCK, enable_prefix_caching=False, groups=GEMMA_LIKE)
    # A long context costs one full-group block per 4 tokens plus 3 blocks in each of 5
    # sliding groups: 40 free blocks hold 25 full-group blocks, 100 tokens.
    assert manager.admissible_tokens(10_000) == 100
    assert manager.admissible_tokens(50) == 50
    one_group = KVCacheManager(num_blocks=40, block_size=BLOCK, enable_prefix_caching=False)
    assert one_group.admissible_tokens(10_000) == 160
    # The worst case of a request counts each sliding group's window, not its whole length.
    assert worst_case_blocks(90, 10, 1, BLOCK, GEMMA_LIKE, chunk_tokens=8) == 25 + 5 * (2 + 2 + 2)


def test_a_gemma_engine_publishes_free_tokens_and_answers_alike_without_groups(tiny_models: dict[str, Path]) -> None:
    """Gemma 3 (a sliding layer of window 8 and a global one) on one KV budget: grouped, a
    new request can take twice the context it could with one group (the sliding layer keeps
    only its window), and greedy tokens are the same either way."""
    model_dir = str(tiny_models["gemma3"])
    budget = 1 << 20
    grouped = LLM(model_dir, dtype="float32", kv_cache_memory=budget, separate_process=False)
    plain = LLM(
        model_dir, dtype="float32", kv_cache_memory=budget, disable_hybrid_kv_cache_manager=True, separate_process=False
    )
    assert grouped.engine.kv_cache.groups.num_groups == 2 and plain.engine.kv_cache.groups.num_groups == 1
    free = grouped.stats().num_free_blocks
    assert free == 2 * plain.stats().num_free_blocks, "blocks of one layer, not two"
    # A context of T tokens takes ceil(T / 16) full-group blocks and at most 2 sliding ones.
    assert grouped.stats().num_free_tokens == (free - 2) * 16
    assert plain.stats().num_free_tokens == plain.stats().num_free_blocks * 16
    prompts = random_prompts([40, 3, 70], TINY_VOCAB, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in grouped.generate(prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert_no_block_leaked(grouped)


def test_gemma4s_shared_layers_read_their_sources_cache_and_shapes_share_padded_pages(
    tiny_models: dict[str, Path],
) -> None:
    """Gemma 4: the last two layers attend over the first two's KV, so only two layers hold
    a cache; the global layer's keys (1 head of 64) and the sliding one's (2 heads of 16)
    share one tensor index, each block id one page sized for the larger (16 x 64)."""
    llm = LLM(str(tiny_models["gemma4"]), dtype="float32", kv_cache_memory=1 << 20, separate_process=False)
    runner = llm.engine.runner
    assert llm.engine.parts.model_config.cache_layers == [0, 1]
    assert runner.groups.windows == (None, 8) and runner.groups.layer_groups == (1, 0)
    assert runner.kv_caches[2] is runner.kv_caches[0] and runner.kv_caches[3] is runner.kv_caches[1]
    num_blocks = llm.stats().num_free_blocks
    assert [tuple(keys.shape) for keys, _ in runner.kv_tensors] == [(num_blocks, 1, 1, 16 * 64)]
    assert [tuple(keys.shape[1:]) for keys, _ in runner.cache_layer_caches] == [(16, 2, 16), (16, 1, 64)]
    page_bytes = 2 * 16 * 64 * 4  # keys and values, 16 tokens of the larger shape, float32
    assert num_blocks == (1 << 20) // page_bytes
    assert kv_bytes_per_block(llm.engine.parts.model_config, 16, torch.float32) == 2 * 16 * (2 * 16 + 64) * 4
