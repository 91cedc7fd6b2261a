"""The engine's half of prefill/decode disaggregation, without the network: a prefill
engine pins a finished prompt's blocks, a decode engine loads them into fresh blocks and
computes only the last prompt token, and nothing leaks on either side."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.core.kv_groups import needed_blocks
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.kv_connector.prefill_decode import PrefillDecodeConnector
from pagefleet.engine.kv_transfer import wire
from pagefleet.engine.kv_transfer.params import RemoteKV
from pagefleet.engine.kv_transfer.transport import tokens_to_pull
from pagefleet.protocol.kv_transfer import per_group
from tests.engine.helpers import assert_no_block_leaked, random_prompts

PREFILL = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def _pull(prefill: LLM, prompt: list[int]) -> RemoteKV:
    """What the HTTP pull does, in process: read the pinned blocks (per KV cache group, those
    the last prompt token's query needs), free them."""
    answer = prefill.generate([{"prompt_token_ids": prompt}], PREFILL)[0]
    params = answer.kv_transfer_params
    assert params is not None and params["do_remote_prefill"]
    num_tokens = tokens_to_pull(len(prompt))
    layout = prefill.engine.kv_connector.layout
    needed = needed_blocks(layout.kv_groups, num_tokens, layout.block_size)
    blocks = [ids[: len(r)] for ids, r in zip(per_group(params["remote_block_ids"]), needed, strict=True)]
    connector = _pd(prefill)
    pinned = connector.checkout(params["remote_request_id"], blocks)
    assert pinned.token_ids == prompt
    layers = connector.read_blocks(blocks)
    assert connector.release(params["remote_request_id"])
    keys, values = [k for k, _ in layers], [v for _, v in layers]
    return RemoteKV(num_tokens, keys, values, first_blocks=layout.first_blocks(num_tokens))


def _pd(llm: LLM) -> PrefillDecodeConnector:
    connector = llm.engine.kv_connector.member(PrefillDecodeConnector)
    assert connector is not None
    return connector


@pytest.fixture(scope="module")
def engines(tiny_llama: Path) -> tuple[LLM, LLM, LLM]:
    kwargs = {"model": str(tiny_llama), "num_kv_blocks": 64, "dtype": "float32"}
    return LLM(**kwargs, kv_role="prefill"), LLM(**kwargs, kv_role="decode"), LLM(**kwargs)


@pytest.mark.parametrize("length", [1, 15, 16, 17, 70])
def test_decoding_on_pulled_kv_equals_computing_the_prompt(engines: tuple[LLM, LLM, LLM], length: int) -> None:
    prefill, decode, colocated = engines
    (prompt,) = random_prompts([length], vocab=200, seed=length)
    greedy = SamplingParams(max_tokens=10, temperature=0)
    expected = colocated.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
    remote = _pull(prefill, prompt)
    engine = decode.engine
    chunk_sizes: list[list[int]] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        plan = schedule()
        chunk_sizes.append([chunk.num_new_tokens for chunk in plan.chunks])
        return plan

    engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    try:
        engine.add_request("d", {"prompt_token_ids": prompt}, greedy, remote)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
    finally:
        engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    # Only the last prompt token is computed here: the rest came from the prefill engine.
    assert chunk_sizes[0] == [1]
    assert outputs[-1].outputs[0].token_ids == expected
    for llm in engines:
        assert_no_block_leaked(llm)


def test_the_pulled_kv_is_what_the_answer_rests_on(engines: tuple[LLM, LLM, LLM]) -> None:
    """Zeroed keys and values change the answer: the decode engine did not recompute them."""
    prefill, decode, colocated = engines
    (prompt,) = random_prompts([70], vocab=200, seed=3)
    greedy = SamplingParams(max_tokens=10, temperature=0)
    expected = colocated.generate([{"prompt_token_ids": prompt}], greedy)[0].outputs[0].token_ids
    remote = _pull(prefill, prompt)
    zeroed = RemoteKV(
        remote.num_tokens, [torch.zeros_like(k) for k in remote.keys], [torch.zeros_like(v) for v in remote.values]
    )
    decode.engine.add_request("z", {"prompt_token_ids": prompt}, greedy, zeroed)
    outputs = []
    while decode.engine.has_unfinished_requests():
        outputs += decode.engine.step()
    assert outputs[-1].outputs[0].token_ids != expected
    assert_no_block_leaked(decode)


def test_pins_expire_and_roles_refuse_the_other_half(engines: tuple[LLM, LLM, LLM]) -> None:
    prefill, decode, _ = engines
    (prompt,) = random_prompts([40], vocab=200, seed=5)
    prefill.generate([{"prompt_token_ids": prompt}], PREFILL)
    assert prefill.stats().num_pinned_blocks == 3
    assert _pd(prefill).pins.expire(now=float("inf")) == 1
    assert prefill.stats().num_pin_timeouts >= 1
    assert_no_block_leaked(prefill)
    with pytest.raises(InvalidParameterError, match="--role decode"):
        decode.generate([{"prompt_token_ids": prompt}], PREFILL)
    remote = RemoteKV(0, [], [])
    with pytest.raises(InvalidParameterError, match="--role prefill"):
        prefill.engine.add_request("p", {"prompt_token_ids": prompt}, SamplingParams(), remote)
    for bad, words in (("yes", "must be an object"), ({"do_remote_prefill": True}, "needs remote_engine_id")):
        with pytest.raises(InvalidParameterError, match=words) as refused:
            prefill.generate([{"prompt_token_ids": prompt}], SamplingParams(extra_args={"kv_transfer_params": bad}))
        assert refused.value.param == "kv_transfer_params"
    assert_no_block_leaked(prefill)


def test_kv_transfer_params_read_what_they_write() -> None:
    """protocol/kv_transfer.py, the one module that reads and writes them: a prefill
    replica's answer parses into where to pull from, and the prefill request into its flag."""
    from pagefleet.protocol.kv_transfer import KVTransferParams, for_prefill, of_prefill_answer, prefill_answer

    answer = prefill_answer("req-1", [4, 9], "engine-a", "10.0.0.7", 8001)
    read = KVTransferParams.parse(of_prefill_answer({"kv_transfer_params": answer}))
    assert read is not None and not read.remote_decode and read.remote_prefill is not None
    assert (read.remote_prefill.host, read.remote_prefill.port, read.remote_prefill.block_ids) == (
        "10.0.0.7",
        8001,
        [4, 9],
    )
    assert KVTransferParams.parse(for_prefill()) == KVTransferParams(remote_decode=True)
    assert KVTransferParams.parse({}) is None and KVTransferParams.parse(None) is None
    assert of_prefill_answer({"kv_transfer_params": for_prefill()}) is None  # not an answer to pull from


def test_frames_carry_tensors_byte_for_byte_in_any_pieces() -> None:
    tensors = [torch.randn(2, 16, 3, 8), torch.randn(2, 16, 3, 8).to(torch.bfloat16), torch.empty(0, 16, 3, 8)]
    stream = wire.frame({"kind": "hello"}) + b"".join(wire.tensor_frame("key", i, t) for i, t in enumerate(tensors))
    reader = wire.FrameReader()
    frames = []
    for start in range(0, len(stream), 997):  # network-sized pieces, cut mid-header and mid-payload
        frames += reader.feed(stream[start : start + 997])
    assert reader.pending == 0 and frames[0][0] == {"kind": "hello"}
    for (header, payload), tensor in zip(frames[1:], tensors, strict=True):
        assert torch.equal(wire.tensor_from(header, payload), tensor)
    with pytest.raises(ValueError, match="not a pagefleet KV transfer stream"):
        wire.FrameReader().feed(b"GARBAGE!" * 4)
