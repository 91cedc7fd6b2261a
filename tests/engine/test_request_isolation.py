"""One bad request fails only itself; a caller that leaves frees its blocks at once.

The engine validates every parameter, so a request that fails inside the step means a
validation gap. These tests open such gaps on purpose, by changing a request's parameters
after they were validated, and check that the request fails alone with finish reason
"error", that every other request in the same batch still gives its exact greedy output,
and that no block leaks.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pagefleet.engine import LLM, AsyncEngine, SamplingParams
from pagefleet.engine.errors import RequestFailedError
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256)


def _broken_sampling() -> SamplingParams:
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    params.top_p = None  # type: ignore[assignment]  # the sampler's batched tensors now fail
    return params


def _broken_beam_scoring() -> SamplingParams:
    # Issue 13's reproduction: len ** 1e308 overflows inside the beam search's scoring.
    params = SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=8, ignore_eos=True)
    params.length_penalty = 1e308
    return params


def _broken_stop_check() -> SamplingParams:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params.stop = [None]  # type: ignore[list-item]  # the stop-string search now fails
    return params


@pytest.mark.parametrize("broken", [_broken_sampling, _broken_beam_scoring, _broken_stop_check])
def test_a_request_that_fails_in_the_step_fails_alone(llm: LLM, broken) -> None:  # type: ignore[no-untyped-def]
    prompts = random_prompts([7, 21, 13], TINY_VOCAB, seed=40)
    alone = llm.generate([prompts[0], prompts[2]], GREEDY)
    outputs = llm.generate(prompts, [GREEDY, broken(), GREEDY])

    failed = outputs[1]
    assert failed.finished and failed.error is not None
    assert {c.finish_reason for c in failed.outputs} == {"error"}
    for output, reference in zip([outputs[0], outputs[2]], alone, strict=True):
        assert output.error is None
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
    assert_no_block_leaked(llm)
    # The engine runs on: the next batch is served as before.
    assert llm.generate(prompts[0], GREEDY)[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert_no_block_leaked(llm)


def test_wide_seeds_are_reproducible_and_too_wide_ones_refused(llm: LLM) -> None:
    (prompt,) = random_prompts([9], TINY_VOCAB, seed=41)
    for seed in (2**62, -(2**62), 2**63 - 1, -(2**63)):
        params = SamplingParams(temperature=1.0, max_tokens=6, seed=seed, n=2)
        first, second = llm.generate(prompt, params)[0], llm.generate(prompt, params)[0]
        assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    for seed in (2**63, -(2**63) - 1, 2**70):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    assert_no_block_leaked(llm)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("repetition_penalty", float("inf")),
        ("length_penalty", 1e308),
        ("top_p", float("nan")),
    ],
)
def test_non_finite_or_overflowing_numbers_are_refused(field: str, value: float) -> None:
    kwargs: dict[str, object] = {field: value}
    if field == "length_penalty":
        kwargs |= {"use_beam_search": True, "beam_width": 2}
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([1, 2, 3], SamplingParams(stop_token_ids=[TINY_VOCAB + 5]))
    assert_no_block_leaked(llm)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path):  # type: ignore[no-untyped-def]
    engine = AsyncEngine(model=str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=256)
    yield engine
    engine.shutdown()


def test_async_caller_of_a_failed_request_gets_an_error_and_others_finish(engine: AsyncEngine) -> None:
    prompts = random_prompts([11, 17], TINY_VOCAB, seed=42)

    async def collect(prompt: list[int], params: SamplingParams) -> list[int]:
        final = None
        async for output in engine.generate(prompt, params):
            final = output
        assert final is not None
        return final.outputs[0].token_ids

    async def run() -> list[object]:
        return await asyncio.gather(
            collect(prompts[0], GREEDY), collect(prompts[1], _broken_sampling()), return_exceptions=True
        )

    healthy, failed = asyncio.run(run())
    assert isinstance(failed, RequestFailedError) and "top_p" not in str(type(failed))
    assert isinstance(healthy, list) and len(healthy) == 12
    assert engine.is_running
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_cancelled_caller_frees_its_blocks_before_the_next_step(engine: AsyncEngine) -> None:
    """The abort of a cancelled task cannot await anything: it must still happen."""
    (prompt,) = random_prompts([30], TINY_VOCAB, seed=43)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    received = 0

    async def read_forever() -> None:
        nonlocal received
        async for _ in engine.generate(prompt, params):
            received += 1

    async def cancel_after_a_few_tokens() -> None:
        task = asyncio.create_task(read_forever())
        while received < 3:
            await asyncio.sleep(0.001)
        while not task.done():  # as anyio's cancel scopes do: every await fails until it ends
            task.cancel()
            await asyncio.sleep(0)
        deadline = asyncio.get_running_loop().time() + 1.0
        while engine.stats().num_running_requests or engine.stats().num_waiting_requests:
            assert asyncio.get_running_loop().time() < deadline, "the cancelled request still runs after 1 s"
            await asyncio.sleep(0.005)

    asyncio.run(cancel_after_a_few_tokens())
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_generation_tokens < 200, "the request ran on after its caller left"
