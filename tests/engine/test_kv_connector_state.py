"""The KV connectors with state layers (Qwen3.5's Gated DeltaNet, Granite 4's Mamba-2): a
prefix moves with the state snapshot kept after its last block. A prompt's KV that came by
a prefill/decode pull, from the file tier or from a peer gives the greedy tokens of a plain
run; each moves the blocks up to the prompt's last block boundary and the state there;
nothing leaks after a request finishes, is aborted or its transfer is given up (blocks,
state slots, and the holds on snapshot rows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagefleet.engine import LLM, SamplingParams
from pagefleet.engine.core.block_pool import take_events
from pagefleet.engine.kv_connector.file_tier import FileTierConnector
from pagefleet.engine.kv_connector.peer import PeerConnector
from pagefleet.engine.kv_connector.prefill_decode import PrefillDecodeConnector
from pagefleet.engine.kv_transfer import wire
from pagefleet.engine.kv_transfer.params import KVLayout, RemoteKV
from pagefleet.engine.kv_transfer.transport import assemble, tokens_to_pull
from pagefleet.gateway.prefix_index import ModelIndex
from pagefleet.protocol.block_hash import block_hashes, chain_root, reusable_prefix, state_snapshot_hash
from pagefleet.protocol.kv_transfer import per_group
from tests.conftest import TINY_VOCAB, build_tiny_model
from tests.engine.helpers import assert_no_block_leaked, random_prompts

BLOCK = 8
LENGTHS = [23, 40, 57]  # boundaries 16, 32, 56: the decode side computes 7, 8 and 1 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


def _boundary(num_tokens: int) -> int:
    return (num_tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module", params=["qwen3_5", "granite4"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(request.param, tmp_path_factory.mktemp("state-connectors") / request.param)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(LENGTHS, TINY_VOCAB, seed=12)


@pytest.fixture(scope="module")
def expected(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in _llm(model).generate(prompts, GREEDY)]


def _llm(model: Path, **settings: object) -> LLM:
    return LLM(str(model), dtype="float32", block_size=BLOCK, num_kv_blocks=64, max_num_seqs=4, **settings)  # type: ignore[arg-type]


def _run(llm: LLM, prompt: list[int], given: RemoteKV | None, request_id: str) -> list[int]:
    engine = llm.engine
    engine.add_request(request_id, {"prompt_token_ids": prompt}, GREEDY, given)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.kv_connector.between_steps(wait=True)
    return outputs[-1].outputs[0].token_ids


def _frames(layout: KVLayout, token_ids: list[int], layers, state) -> list:  # type: ignore[no-untyped-def]
    hello = wire.frame({"kind": "hello", "layout": layout.as_dict(), "token_ids": token_ids})
    return wire.FrameReader().feed(hello + b"".join(wire.kv_frames(layers, state)) + wire.frame({"kind": "end"}))


def assert_nothing_held(llm: LLM) -> None:
    assert_no_block_leaked(llm)
    kv_cache = llm.engine.kv_cache
    assert kv_cache.states is not None and kv_cache.states.device.num_free_slots == kv_cache.states.device.num_slots
    assert kv_cache.snapshots is not None and kv_cache.snapshots.num_held == 0


def _pull(prefill: LLM, prompt: list[int]) -> RemoteKV:
    """The HTTP pull, in process: the decode side asks for the blocks up to the prompt's last
    block boundary, the prefill side sends them and the state there, then frees them."""
    params = prefill.generate([{"prompt_token_ids": prompt}], PREFILL)[0].kv_transfer_params
    assert params is not None
    num_tokens = tokens_to_pull(len(prompt), BLOCK)
    asked = [per_group(params["remote_block_ids"])[0][: num_tokens // BLOCK]]
    connector = prefill.engine.kv_connector.member(PrefillDecodeConnector)
    assert connector is not None and connector.read_state is not None
    pinned = connector.checkout(params["remote_request_id"], asked)
    assert pinned.state_row is not None and prefill.engine.kv_cache.snapshots.num_held == 1  # type: ignore[union-attr]
    layers, state = connector.read_blocks(asked), connector.read_state(pinned.state_row)
    assert connector.release(params["remote_request_id"])
    layout = prefill.engine.kv_connector.layout
    tokens = prompt[:num_tokens]
    return assemble(_frames(layout, tokens, layers, state), layout, tokens, "the prefill engine")


def test_decoding_on_a_pulled_prompt_and_its_state_equals_a_plain_run(
    model: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    prefill, decode = _llm(model, kv_role="prefill"), _llm(model, kv_role="decode")
    layout = prefill.engine.kv_connector.layout
    assert layout.has_state and layout.as_dict()["num_state_layers"] == layout.num_state_layers
    for index, prompt in enumerate(prompts):
        remote = _pull(prefill, prompt)
        assert remote.num_tokens == _boundary(len(prompt)) and remote.state is not None
        assert len(remote.state) == layout.num_state_layers
        assert _run(decode, prompt, remote, f"d{index}") == expected[index]
        assert_nothing_held(prefill)
        assert_nothing_held(decode)
    # Shorter than a block and a token: no state to move, so no kv_transfer_params (a
    # gateway then sends the whole request to a decode replica).
    assert prefill.generate([{"prompt_token_ids": prompts[0][:BLOCK]}], PREFILL)[0].kv_transfer_params is None
    # Aborted after its first step, and a pull given up (the pin and its snapshot expire).
    remote = _pull(prefill, prompts[1])
    decode.engine.add_request("gone", {"prompt_token_ids": prompts[1]}, GREEDY, remote)
    decode.engine.step()
    decode.engine.abort_request("gone")
    prefill.generate([{"prompt_token_ids": prompts[2]}], PREFILL)
    connector = prefill.engine.kv_connector.member(PrefillDecodeConnector)
    assert connector is not None and connector.pins.expire(now=float("inf")) == 1
    assert_nothing_held(prefill)
    assert_nothing_held(decode)


def test_the_file_tier_stores_each_prompts_state_and_resumes_from_it(
    model: Path, prompts: list[list[int]], expected: list[list[int]], tmp_path: Path
) -> None:
    writer = _llm(model, kv_cache_dir=str(tmp_path))
    assert [o.outputs[0].token_ids for o in writer.generate(prompts, GREEDY)] == expected
    writer.engine.kv_connector.between_steps(wait=True)
    assert_nothing_held(writer)
    # A snapshot where each prompt's chunks end on a block boundary: its last one before its
    # last token, and its end if that is one (40).
    boundaries = {(n, b) for n in LENGTHS for b in (_boundary(n), n) if b % BLOCK == 0}
    assert len(list(tmp_path.glob("*/*-state.kv"))) == len(boundaries) == len(prompts) + 1
    reader = _llm(model, kv_cache_dir=str(tmp_path))
    outputs = reader.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert [o.num_cached_tokens for o in outputs] == [_boundary(n) for n in LENGTHS]
    assert reader.stats().kv_tier.bad_files == 0  # type: ignore[union-attr]
    assert_nothing_held(reader)
    # Without the state after its blocks a stored prefix is no prefix: computed instead.
    other = _llm(model, kv_cache_dir=str(tmp_path))
    tier = other.engine.kv_connector.member(FileTierConnector)
    assert tier is not None
    full, hashes = reusable_prefix(prompts[1], BLOCK, chain_root())
    tier.tier.store.path(hashes[-1], -1).unlink()
    assert tier.tier.read_prefix(hashes, full, local=0) is None
    (output,) = other.generate([prompts[1]], GREEDY)
    assert output.outputs[0].token_ids == expected[1] and output.num_cached_tokens == 0
    assert_nothing_held(other)


def test_a_peer_serves_a_prefix_with_its_state(
    model: Path, prompts: list[list[int]], expected: list[list[int]]
) -> None:
    holder, reader = _llm(model), _llm(model)
    holder.generate(prompts, GREEDY)
    peer = holder.engine.kv_connector.member(PeerConnector)
    wanting = reader.engine.kv_connector.member(PeerConnector)
    assert peer is not None and wanting is not None and peer.read_state is not None
    layout = holder.engine.kv_connector.layout
    for index, prompt in enumerate(prompts):
        full, hashes = reusable_prefix(prompt, BLOCK, chain_root())
        assert wanting.count_available(hashes, full) == 0 and peer.count_available(hashes, full) == len(hashes)
        # A prefix one block shorter has no snapshot (the prompt's chunks ended at its last boundary only).
        assert peer.count_available(hashes[:-1], full[:-BLOCK]) == 0
        held = peer.hold_prefix(hashes, full)
        assert held.num_blocks == len(hashes) and held.state_row is not None
        try:
            layers, state = peer.read_blocks(held.block_ids), peer.read_state(held.state_row)
        finally:
            peer.release(held)
        tokens = full[: held.num_blocks * BLOCK]
        pulled = assemble(_frames(layout, tokens, layers, state), layout, tokens, "the peer")
        pulled.origin = "peer"
        assert _run(reader, prompt, pulled, f"p{index}") == expected[index]
        assert_nothing_held(holder)
        assert_nothing_held(reader)
        reader.engine.reset_prefix_cache()


def test_the_fleet_index_names_a_prefix_only_as_far_as_its_state_is_kept(model: Path, prompts: list[list[int]]) -> None:
    """The replica publishes its snapshots beside its blocks, each by the name
    `state_snapshot_hash` gives the block it follows; a gateway's index then matches a
    replica of a state model only up to the prompt's last boundary with a snapshot, while
    the blocks alone would count every full block."""
    llm = _llm(model)
    llm.engine.kv_cache.enable_events()
    events = llm.engine.kv_cache.pool.events
    assert events is not None
    prompt = prompts[2]
    (output,) = llm.generate([prompt], GREEDY)
    index = ModelIndex()
    index.store("r", [event.block_hash for event in take_events(events) if event.stored])
    # The 66 tokens computed (57 of the prompt, 9 of its answer) fill 8 blocks; the state is
    # kept after 7 (the prompt's last boundary).
    computed = prompt + output.outputs[0].token_ids[:-1]
    hashes = block_hashes(computed, BLOCK, chain_root())
    assert len(hashes) == 8 and index.matched_blocks(hashes, ["r"]) == {"r": 8}
    assert index.matched_blocks(hashes, ["r"], frozenset({"r"})) == {"r": _boundary(len(prompt)) // BLOCK} == {"r": 7}
    assert state_snapshot_hash(hashes[_boundary(len(prompt)) // BLOCK - 1]) in index.holders
    llm.engine.reset_prefix_cache()
    removed = [event.block_hash for event in take_events(events) if not event.stored]
    assert state_snapshot_hash(hashes[_boundary(len(prompt)) // BLOCK - 1]) in removed
