"""The scheduler on its own, without a model: each step's chunks are "computed" by
committing them to the KV cache manager and appending a token where a sequence reaches its
end, as the engine does after a forward pass."""

from __future__ import annotations

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.request import Request, RequestStatus
from pagefleet.engine.core.scheduler import SchedulePlan, Scheduler
from pagefleet.engine.sample.sampling_params import SamplingParams

SAMPLED = 7  # the token every simulated step "samples"


def _scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    budget: int = 64,
    mode: str = "recompute",
    host_blocks: int = 0,
    prefix_caching: bool = False,
) -> tuple[Scheduler, KVCacheManager]:
    config = EngineConfig(
        block_size=block_size, max_num_batched_tokens=budget, preemption_mode=mode, enable_prefix_caching=prefix_caching
    )
    kv_cache = KVCacheManager(num_blocks, block_size, prefix_caching, num_host_blocks=host_blocks)
    return Scheduler(config, kv_cache), kv_cache


def _request(index: int, prompt_len: int, max_tokens: int = 16, n: int = 1) -> Request:
    prompt = list(range(100 + 1000 * index, 100 + 1000 * index + prompt_len))
    return Request(f"r{index}", None, prompt, SamplingParams(n=n, max_tokens=max_tokens), index, max_tokens)


def _step(scheduler: Scheduler, kv_cache: KVCacheManager) -> SchedulePlan:
    plan = scheduler.schedule()
    for chunk in plan.chunks:
        computed = kv_cache.commit(chunk.seq, chunk.num_new_tokens)
        if computed == chunk.seq.num_tokens:
            chunk.seq.token_ids.append(SAMPLED)
    for request in list(scheduler.running):
        if all(seq.num_output_tokens >= request.max_tokens for seq in request.sequences):
            scheduler.finish(request)
    return plan


def _chunks(plan: SchedulePlan) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_new_tokens) for c in plan.chunks]


def test_requests_are_admitted_first_come_first_served() -> None:
    scheduler, kv_cache = _scheduler(budget=64)
    for index in (2, 0, 1):  # added out of order; arrival order decides
        scheduler.add(_request(index, prompt_len=5))
    assert _chunks(_step(scheduler, kv_cache)) == [("r0", 0, 5), ("r1", 0, 5), ("r2", 0, 5)]
    assert [r.request_id for r in scheduler.running] == ["r0", "r1", "r2"]
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.running)


def test_chunked_prefill_shares_the_token_budget_decodes_first() -> None:
    scheduler, kv_cache = _scheduler(budget=6)
    scheduler.add(_request(0, prompt_len=10))
    scheduler.add(_request(1, prompt_len=3))
    assert _chunks(_step(scheduler, kv_cache)) == [("r0", 0, 6)], "the budget is spent on r0; r1 waits its turn"
    assert _chunks(_step(scheduler, kv_cache)) == [("r0", 6, 4), ("r1", 0, 2)]
    assert _chunks(_step(scheduler, kv_cache)) == [("r0", 10, 1), ("r1", 2, 1)]
    assert _chunks(_step(scheduler, kv_cache)) == [("r0", 11, 1), ("r1", 3, 1)]


def _two_requests_that_outgrow_six_blocks(scheduler: Scheduler, kv_cache: KVCacheManager) -> SchedulePlan:
    """Prompts of 8 tokens (2 blocks of 4 each); the 4th block of each does not fit in 6."""
    scheduler.add(_request(0, prompt_len=8, max_tokens=8))
    scheduler.add(_request(1, prompt_len=8, max_tokens=8))
    for _ in range(5):  # prefill, then decodes at positions 8..11: 3 blocks each, 6 in all
        plan = _step(scheduler, kv_cache)
        assert not plan.preempted
    assert kv_cache.num_free_blocks == 0
    return _step(scheduler, kv_cache)  # position 12 needs a 4th block each


def test_when_blocks_run_out_the_newest_request_is_preempted_by_recompute() -> None:
    scheduler, kv_cache = _scheduler(num_blocks=6)
    plan = _two_requests_that_outgrow_six_blocks(scheduler, kv_cache)
    first, newest = (scheduler.running + scheduler.waiting)[:2]
    assert plan.preempted == [newest] and _chunks(plan) == [("r0", 12, 1)]
    assert newest.status == RequestStatus.WAITING and newest in scheduler.waiting
    assert kv_cache.block_table(newest.sequences[0]) == [] and kv_cache.num_computed_tokens(newest.sequences[0]) == 0
    assert scheduler.stats.num_preemptions_recompute == 1
    # It resumes once the first finishes, computing its prompt and its outputs again.
    while first.status != RequestStatus.FINISHED:
        plan = _step(scheduler, kv_cache)
    resumed = _step(scheduler, kv_cache) if not any(c.request is newest for c in plan.chunks) else plan
    (chunk,) = [c for c in resumed.chunks if c.request is newest]
    assert (chunk.start, chunk.num_new_tokens) == (0, 8 + 5), "its 8 prompt tokens and the 5 outputs it had"


def test_swap_preemption_moves_blocks_to_the_host_and_back() -> None:
    scheduler, kv_cache = _scheduler(num_blocks=6, mode="swap", host_blocks=8)
    plan = _two_requests_that_outgrow_six_blocks(scheduler, kv_cache)
    newest = plan.preempted[0]
    assert newest.request_id == "r1" and newest.status == RequestStatus.SWAPPED
    assert len(plan.copies.swap_out) == 3 and kv_cache.num_free_host_blocks == 5
    assert scheduler.stats.num_preemptions_swap == 1
    while newest.status == RequestStatus.SWAPPED:
        plan = _step(scheduler, kv_cache)
    assert len(plan.copies.swap_in) == 3, "its three blocks come back before it runs"
    (chunk,) = [c for c in plan.chunks if c.request is newest]
    assert chunk.start == 12 and chunk.num_new_tokens == 1, "it goes on where it stopped: no recompute"


def test_a_preempted_request_resumes_before_later_arrivals() -> None:
    scheduler, kv_cache = _scheduler(num_blocks=6)
    plan = _two_requests_that_outgrow_six_blocks(scheduler, kv_cache)
    scheduler.add(_request(2, prompt_len=4, max_tokens=1))  # arrives after r1 was preempted
    assert plan.preempted[0].request_id == "r1"
    assert [r.request_id for r in scheduler.waiting] == ["r1", "r2"]
    admitted = []
    while scheduler.waiting:
        plan = _step(scheduler, kv_cache)
        admitted += [c.request.request_id for c in plan.chunks if c.start == 0 and c.request.request_id not in admitted]
    assert admitted == ["r1", "r2"]


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    scheduler, kv_cache = _scheduler(num_blocks=6)
    scheduler.add(_request(0, prompt_len=8, max_tokens=8))
    scheduler.add(_request(1, prompt_len=8, max_tokens=8))
    for _ in range(5):
        _step(scheduler, kv_cache)
    scheduler.add(_request(2, prompt_len=1, max_tokens=1))
    plan = _step(scheduler, kv_cache)
    assert plan.preempted and all(c.request.request_id != "r2" for c in plan.chunks)


def test_prefix_hits_stop_short_of_the_fork_point() -> None:
    scheduler, kv_cache = _scheduler(prefix_caching=True)
    scheduler.add(_request(0, prompt_len=8, max_tokens=1))
    _step(scheduler, kv_cache)  # r0 computes its 8 prompt tokens: two full blocks are cached
    assert not scheduler.running
    same_prompt = _request(0, prompt_len=8, max_tokens=2, n=2)
    same_prompt.request_id = "r0-again"
    scheduler.add(same_prompt)
    plan = _step(scheduler, kv_cache)
    # Only block 0 is taken from the cache: the prompt's last token must run, to give the
    # logits both samples start from.
    assert same_prompt.num_cached_tokens == 4
    assert _chunks(plan) == [("r0-again", 4, 4)]
    assert kv_cache.stats.prefix_queries == 16 and kv_cache.stats.prefix_hits == 4


def test_a_request_larger_than_the_whole_cache_is_never_scheduled() -> None:
    scheduler, kv_cache = _scheduler(num_blocks=4, budget=64)
    scheduler.add(_request(0, prompt_len=20))  # 5 blocks of 4; the cache has 4
    plan = scheduler.schedule()
    assert plan.is_empty and [r.request_id for r in scheduler.waiting] == ["r0"]
    assert kv_cache.num_free_blocks == 4, "nothing is held by a request that did not fit"


def _events(request: Request) -> list[tuple[str, dict[str, int | str | bool]]]:
    return [(event.name, event.attributes) for event in request.events]


def test_a_request_records_its_queueing_prefill_chunks_and_preemptions_for_its_trace() -> None:
    scheduler, kv_cache = _scheduler(num_blocks=6)
    plan = _two_requests_that_outgrow_six_blocks(scheduler, kv_cache)
    first, newest = (scheduler.running + scheduler.waiting)[:2]
    assert _events(first) == [
        ("scheduled", {"cached_tokens": 0, "resumed": False}),
        ("prefill_chunk", {"start": 0, "tokens": 8}),
    ]
    assert plan.preempted == [newest]
    while newest.status != RequestStatus.RUNNING:
        _step(scheduler, kv_cache)
    names = [name for name, _ in _events(newest)]
    assert names[names.index("preempted") :] == ["preempted", "scheduled", "prefill_chunk"]
    assert _events(newest)[names.index("preempted") :][:2] == [
        ("preempted", {"mode": "recompute"}),
        ("scheduled", {"cached_tokens": 0, "resumed": True}),
    ]
    times = [event.time for event in newest.events]
    assert times == sorted(times)


def test_a_swapped_request_records_the_swap() -> None:
    scheduler, kv_cache = _scheduler(num_blocks=6, mode="swap", host_blocks=8)
    newest = _two_requests_that_outgrow_six_blocks(scheduler, kv_cache).preempted[0]
    assert _events(newest)[-1] == ("preempted", {"mode": "swap"})
    while newest.status != RequestStatus.RUNNING:
        _step(scheduler, kv_cache)
    assert _events(newest)[-1] == ("scheduled", {"cached_tokens": 0, "resumed": True})  # no prompt chunk: no recompute
