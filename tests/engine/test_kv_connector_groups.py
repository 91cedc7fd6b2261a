"""The KV connectors with KV cache groups: Gemma's sliding layer (window 8) and its global
layer, blocks of 4 tokens, prompts many windows long. A prompt's KV that came by a
prefill/decode pull, from the file tier or from a peer gives the greedy tokens of a plain
run; the full group moves every block of the prefix, the sliding group only the blocks its
next query still sees; nothing leaks after a request finishes, is aborted, or its
transfer is given up. Gemma 4 adds a global layer whose keys have another shape (1 head of
64 against 2 of 16) and two KV-shared layers, which hold no cache and move nothing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.kv_connector.file_tier import FileTierConnector
from pagefleet.engine.kv_connector.peer import PeerConnector
from pagefleet.engine.kv_connector.prefill_decode import PrefillDecodeConnector
from pagefleet.engine.kv_transfer import wire
from pagefleet.engine.kv_transfer.params import RemoteKV
from pagefleet.engine.kv_transfer.transport import assemble, tokens_to_pull
from pagefleet.protocol.block_hash import chain_root, reusable_prefix
from pagefleet.protocol.kv_transfer import per_group
from tests.conftest import TINY_VOCAB
from tests.engine.helpers import assert_no_block_leaked, random_prompts

BLOCK = 4
WINDOW = 8  # the tiny Gemmas' sliding window
FULL_GROUP, SLIDING_GROUP = 0, 1
SLIDING_LAYER, FULL_LAYER = 0, 1  # layer_types: sliding, full
# 23 - 1 = 22 tokens pulled: the last query (position 22) reads from key 15, in block 3,
# which a query at 23 no longer sees (the prefill side keeps it for the decode side).
LENGTHS = [23, 40, 57]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def _blocks(num_tokens: int) -> tuple[int, int]:
    """(full group, sliding group) blocks to go on from `num_tokens` tokens: every block, and
    those holding keys num_tokens - 7 onwards (the next query's window of 8)."""
    num_blocks = math.ceil(num_tokens / BLOCK)
    return num_blocks, num_blocks - max(0, num_tokens - WINDOW + 1) // BLOCK


def _rows(kv: RemoteKV) -> tuple[int, int]:
    return kv.keys[FULL_LAYER].shape[0], kv.keys[SLIDING_LAYER].shape[0]


def _llm(model: Path, **settings: object) -> LLM:
    llm = LLM(str(model), dtype="float32", block_size=BLOCK, num_kv_blocks=96, **settings)  # type: ignore[arg-type]
    groups = llm.engine.kv_cache.groups
    assert groups.windows == (None, WINDOW) and groups.layer_groups == (SLIDING_GROUP, FULL_GROUP)
    return llm


def _run(llm: LLM, prompt: list[int], given: RemoteKV | None, request_id: str) -> RequestOutput:
    engine = llm.engine
    engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY, given)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.kv_connector.between_steps(wait=True)
    return outputs[-1]


def _loaded_rows(llm: LLM) -> list[tuple[int, int]]:
    """Record every load the scheduler queues: (full layer, sliding layer) blocks written."""
    manager, loads = llm.engine.kv_cache, []
    queue_load = manager.queue_load

    def recording(seq, remote):  # type: ignore[no-untyped-def]
        queue_load(seq, remote)
        load = manager.pending.loads[-1]
        loads.append((len(load.block_ids[FULL_LAYER]), len(load.block_ids[SLIDING_LAYER])))

    manager.queue_load = recording  # type: ignore[method-assign]
    return loads


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "gemma4"])
def model(request: pytest.FixtureRequest, tiny_models: dict[str, Path]) -> Path:
    return tiny_models[request.param]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, TINY_VOCAB, seed=11)


@pytest.fixture(scope="module")
def expected(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    plain = _llm(model)
    return [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY)]


def _pull(prefill: LLM, prompt: list[int]) -> RemoteKV:
    """The HTTP pull, in process: the decode side asks each group's blocks it needs, the
    prefill side sends them in frames and frees them."""
    params = prefill.generate([{"prompt_token_ids": prompt}], PREFILL)[0].kv_transfer_params
    assert params is not None
    held = per_group(params["remote_block_ids"])
    num_tokens = tokens_to_pull(len(prompt))
    # Pinned: each group's prompt blocks, the sliding group's from the window of the last query on.
    prompt_blocks = math.ceil(len(prompt) / BLOCK)
    assert [len(ids) for ids in held] == [prompt_blocks, prompt_blocks - max(0, num_tokens - WINDOW + 1) // BLOCK]
    assert prefill.stats().num_pinned_blocks == sum(len(ids) for ids in held)
    needed = _blocks(num_tokens)
    asked = [held[FULL_GROUP][: needed[0]], held[SLIDING_GROUP][: needed[1]]]
    connector = prefill.engine.kv_connector.member(PrefillDecodeConnector)
    assert connector is not None
    connector.checkout(params["remote_request_id"], asked)
    layers = connector.read_blocks(asked)
    assert connector.release(params["remote_request_id"])
    layout = prefill.engine.kv_connector.layout
    return assemble(_frames(layout, prompt[:num_tokens], layers), layout, prompt[:num_tokens], "the prefill engine")


def _frames(layout, token_ids, layers):  # type: ignore[no-untyped-def]
    hello = {"kind": "hello", "layout": layout.as_dict(), "token_ids": token_ids}
    frames = [wire.frame(hello)]
    for layer, (keys, values) in enumerate(layers):
        frames += [wire.tensor_frame("key", layer, keys), wire.tensor_frame("value", layer, values)]
    reader = wire.FrameReader()
    return reader.feed(b"".join(frames) + wire.frame({"kind": "end"}))


def test_decoding_on_pulled_kv_moves_each_group_s_blocks_and_equals_a_plain_run(
    model: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    prefill, decode = _llm(model, kv_role="prefill"), _llm(model, kv_role="decode")
    loads = _loaded_rows(decode)
    for index, prompt in enumerate(prompts):
        remote = _pull(prefill, prompt)
        num_tokens = tokens_to_pull(len(prompt))
        assert _rows(remote) == _blocks(num_tokens), "the sliding group moves only its window"
        output = _run(decode, prompt, remote, f"d{index}")
        assert output.outputs[0].token_ids == expected[index]
        assert loads[-1] == _blocks(num_tokens)
        assert_no_block_leaked(prefill)
        assert_no_block_leaked(decode)
    # Aborted before its first step, and a pull given up (pins expire): nothing held.
    remote = _pull(prefill, prompts[1])
    decode.engine.add_request("gone", {"prompt_token_ids": prompts[1]}, GREEDY, remote)
    decode.engine.step()
    decode.engine.abort_request("gone")
    decode.engine.add_request("never", {"prompt_token_ids": prompts[1]}, GREEDY, remote)
    decode.engine.abort_request("never")
    prefill.generate([{"prompt_token_ids": prompts[2]}], PREFILL)
    connector = prefill.engine.kv_connector.member(PrefillDecodeConnector)
    assert connector is not None and connector.pins.expire(now=float("inf")) == 1
    assert_no_block_leaked(prefill)
    assert_no_block_leaked(decode)


def test_the_file_tier_stores_each_group_and_reads_only_the_window(
    model: Path, prompts: list[list[int]], expected: list[list[int]], tmp_path: Path
) -> None:
    writer = _llm(model, kv_cache_dir=str(tmp_path))
    assert [o.outputs[0].token_ids for o in writer.generate(prompts, GREEDY)] == expected
    writer.engine.kv_connector.between_steps(wait=True)
    assert_no_block_leaked(writer)
    sliding_files = list(tmp_path.glob("*/*-g1.kv"))
    assert sliding_files and len(list(tmp_path.glob("*/*.kv"))) > len(sliding_files)
    prompt = prompts[2]
    full, hashes = reusable_prefix(prompt, BLOCK, chain_root())
    reader = _llm(model, kv_cache_dir=str(tmp_path))
    connector = reader.engine.kv_connector.member(FileTierConnector)
    assert connector is not None
    store = connector.tier.store
    # The sliding group's blocks before the prefix's last window are never read: gone, a hit all the same.
    num_blocks = len(hashes)
    first_needed = num_blocks - _blocks(num_blocks * BLOCK)[1]
    for index in range(first_needed):
        store.path(hashes[index], SLIDING_GROUP).unlink(missing_ok=True)
    stored = connector.tier.read_prefix(hashes, full, local=0)
    assert stored is not None and stored.num_tokens == num_blocks * BLOCK
    assert _rows(stored) == _blocks(num_blocks * BLOCK)
    loads = _loaded_rows(reader)
    outputs = reader.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.num_cached_tokens for o in outputs] == [(n - 1) // BLOCK * BLOCK for n in LENGTHS]
    assert sorted(loads) == sorted(_blocks((n - 1) // BLOCK * BLOCK) for n in LENGTHS)
    assert reader.stats().kv_tier.bad_files == 0  # type: ignore[union-attr]
    assert_no_block_leaked(reader)
    # A sliding block of the last window missing: the prefix ends where every group has its window.
    other = _llm(model, kv_cache_dir=str(tmp_path))
    tier = other.engine.kv_connector.member(FileTierConnector)
    assert tier is not None
    full, hashes = reusable_prefix(prompts[1], BLOCK, chain_root())
    store.path(hashes[-1], SLIDING_GROUP).unlink()
    shorter = tier.tier.read_prefix(hashes, full, local=0)
    num_blocks = len(hashes) - 1
    assert shorter is not None and shorter.num_tokens == num_blocks * BLOCK
    assert _rows(shorter) == _blocks(num_blocks * BLOCK)
    output = _run(other, prompts[1], None, "shorter")
    assert output.outputs[0].token_ids == expected[1] and output.num_cached_tokens == num_blocks * BLOCK
    other.engine.add_request("gone", {"prompt_token_ids": prompts[1]}, GREEDY)
    other.engine.abort_request("gone")
    assert_no_block_leaked(other)


def test_a_peer_serves_each_group_s_blocks_of_a_prefix(
    model: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    holder, reader = _llm(model), _llm(model)
    holder.generate(prompts, GREEDY)
    peer = holder.engine.kv_connector.member(PeerConnector)
    wanting = reader.engine.kv_connector.member(PeerConnector)
    assert peer is not None and wanting is not None
    layout = holder.engine.kv_connector.layout
    loads = _loaded_rows(reader)
    for index, prompt in enumerate(prompts):
        full, hashes = reusable_prefix(prompt, BLOCK, chain_root())
        assert wanting.count_available(hashes, full) == 0 and peer.count_available(hashes, full) == len(hashes)
        held = peer.hold_prefix(hashes, full)
        num_blocks = held.num_blocks
        assert num_blocks == len(hashes) and held.state_row is None
        assert tuple(len(blocks) for blocks in held.block_ids) == _blocks(num_blocks * BLOCK)
        try:
            layers = peer.read_blocks(held.block_ids)
        finally:
            peer.release(held)
        tokens = full[: num_blocks * BLOCK]
        pulled = assemble(_frames(layout, tokens, layers), layout, tokens, "the peer")
        pulled.origin = "peer"
        output = _run(reader, prompt, pulled, f"p{index}")
        assert output.outputs[0].token_ids == expected[index] and output.num_cached_tokens == num_blocks * BLOCK
        assert loads[-1] == _blocks(num_blocks * BLOCK)
        assert_no_block_leaked(holder)
        assert_no_block_leaked(reader)
    reader.engine.reset_prefix_cache()
    reader.engine.add_request("gone", {"prompt_token_ids": prompts[-1]}, GREEDY, pulled)
    reader.engine.abort_request("gone")
    assert_no_block_leaked(reader)
