"""The affinity policy's decision (gateway/decision.py) and the ledger of what a router sent
(gateway/inflight.py), as scenarios over replica records."""

from __future__ import annotations

import time

from pagefleet.gateway.decision import DEFAULT_PREFILL_TOKENS_PER_S, Candidate, decide
from pagefleet.gateway.inflight import PENDING_PREFIX_S, InFlight
from pagefleet.gateway.prefix_index import ModelIndex
from pagefleet.protocol.replica import ReplicaRecord

PROMPT = 500  # tokens; 30 cached blocks of 16 leave 20 to compute


def _replica(
    name: str, free: int = 100, queued_tokens: int = 0, rate: float = 1000.0, age_s: float = 0.0, running: int = 0
) -> ReplicaRecord:
    return ReplicaRecord(
        replica_id=name,
        model="m",
        url=f"http://127.0.0.1:{8000 + ord(name[0])}",
        free_blocks=free,
        total_blocks=200,
        block_size=16,
        running=running,
        waiting=1 if queued_tokens else 0,
        max_model_len=4096,
        waiting_prompt_tokens=queued_tokens,
        prefill_tokens_per_s=rate,
        timestamp=time.time() - age_s,
    )


def test_the_longest_cached_prefix_wins_over_free_blocks() -> None:
    holder, empty = Candidate(_replica("a", free=40), cached_blocks=30), Candidate(_replica("b", free=180))
    decision = decide([empty, holder], PROMPT, saturation_s=1.0)
    assert (decision.replica.replica_id, decision.reason, decision.cached_blocks) == ("a", "affinity", 30)
    assert [r.replica_id for r in decision.fallbacks] == ["b"]
    longer = Candidate(_replica("c", free=10), cached_blocks=31)
    assert decide([holder, longer, empty], PROMPT, saturation_s=1.0).replica.replica_id == "c"


def test_a_saturated_holder_spills_to_where_the_request_costs_least() -> None:
    # 3,000 queued prompt tokens at 1,000 tokens/s: 3 s of prefill waits there; elsewhere the
    # whole prompt costs 4 x 0.5 s (COLD_PREFILL_WEIGHT), less than the holder's queue.
    holder = Candidate(_replica("a", queued_tokens=3000), cached_blocks=30)
    roomy, cramped = Candidate(_replica("b", free=150)), Candidate(_replica("c", free=50))
    decision = decide([holder, cramped, roomy], PROMPT, saturation_s=1.0)
    assert (decision.replica.replica_id, decision.reason) == ("b", "saturated"), "ties: the most room"
    assert decision.holder is not None and decision.holder.replica_id == "a", "b may pull the prefix from a"
    shorter_queue = Candidate(_replica("a", queued_tokens=1500), cached_blocks=30)
    below = decide([shorter_queue, roomy], PROMPT, saturation_s=2.0)
    assert (below.reason, below.holder) == ("affinity", None), "below the threshold: no peer to pull from"
    over = decide([shorter_queue, roomy], PROMPT, saturation_s=1.0)
    assert over.reason == "affinity", "over the threshold, but 2 s of cold prefill elsewhere cost more than 1.5 s here"
    # Tokens this router sent since the holder's report count as queued too.
    sent = Candidate(_replica("a"), cached_blocks=30, promised_prompt_tokens=3000)
    assert decide([sent, roomy], PROMPT, saturation_s=1.0).reason == "saturated"
    # A replica that has not measured its prefill yet is judged at the default rate.
    unmeasured = Candidate(_replica("a", queued_tokens=int(DEFAULT_PREFILL_TOKENS_PER_S * 0.5), rate=0.0), 30)
    assert decide([unmeasured, roomy], PROMPT, saturation_s=1.0).reason == "affinity"


def test_a_short_prefix_every_prompt_shares_does_not_pull_every_request_to_one_replica() -> None:
    # Two cached blocks save 32 tokens: 0.128 s of weighted prefill, less than the queue.
    holder = Candidate(_replica("a", queued_tokens=200), cached_blocks=2)
    idle = Candidate(_replica("b"))
    assert decide([holder, idle], PROMPT, saturation_s=1.0).replica.replica_id == "b"
    assert decide([Candidate(_replica("a", queued_tokens=100), 2), idle], PROMPT, 1.0).reason == "affinity"


def test_running_requests_count_in_the_queue() -> None:
    # A replica busy decoding has no waiting prompt, but each running request delays a new
    # one: 10 running count as 160 prompt tokens, more than two cached blocks save.
    idle = Candidate(_replica("b"))
    decoding = Candidate(_replica("a", running=10), cached_blocks=2)
    assert decide([decoding, idle], PROMPT, saturation_s=1.0).replica.replica_id == "b"
    assert decide([Candidate(_replica("a", running=2), 2), idle], PROMPT, 1.0).reason == "affinity"
    # With nothing cached, fewer running requests break a tie in free blocks.
    busy, quiet = Candidate(_replica("a", running=6)), Candidate(_replica("c", running=1))
    assert decide([busy, quiet], PROMPT, saturation_s=1.0).replica.replica_id == "c"


def test_a_saturated_holder_keeps_a_request_moving_would_cost_more() -> None:
    """Moving costs the whole prompt's prefill, and what it delays behind it: with queues
    as long everywhere, the holder, which computes 20 tokens of it instead of 500, keeps it."""
    a = Candidate(_replica("a", free=20, queued_tokens=5000), cached_blocks=30)
    b = Candidate(_replica("b", free=120, queued_tokens=5000))
    decision = decide([a, b], PROMPT, saturation_s=1.0)
    assert (decision.replica.replica_id, decision.reason) == ("a", "affinity")
    shorter = Candidate(_replica("b", free=120, queued_tokens=2900))
    assert decide([a, shorter], PROMPT, saturation_s=1.0).replica.replica_id == "b", "2.1 s sooner there"


def test_load_counts_promised_blocks_and_the_requests_own_cached_blocks_as_room() -> None:
    promised = Candidate(_replica("a", free=120), promised_blocks=50)
    free = Candidate(_replica("b", free=100))
    assert decide([promised, free], PROMPT, saturation_s=1.0).replica.replica_id == "b"
    # Ties on room: the shorter prompt queue.
    tie_busy, tie_idle = Candidate(_replica("a", free=100, queued_tokens=300)), Candidate(_replica("b", free=100))
    assert decide([tie_busy, tie_idle], PROMPT, saturation_s=1.0).replica.replica_id == "b"


def test_a_session_sticks_where_no_prefix_is_cached_unless_its_replica_is_saturated() -> None:
    a, b = Candidate(_replica("a", free=50)), Candidate(_replica("b", free=150))
    assert decide([a, b], PROMPT, saturation_s=1.0).reason == "load"
    assert (
        decide([a, b], PROMPT, 1.0, session_replica_id="a").replica.replica_id,
        decide([a, b], PROMPT, 1.0, "a").reason,
    ) == (
        "a",
        "session",
    )
    busy = Candidate(_replica("a", free=50, queued_tokens=3000))
    assert decide([busy, b], PROMPT, 1.0, session_replica_id="a").replica.replica_id == "b"
    cached = Candidate(_replica("b", free=150), cached_blocks=3)
    assert decide([a, cached], PROMPT, 1.0, session_replica_id="a").reason == "affinity", "a cached prefix beats a hint"
    assert decide([a, b], PROMPT, 1.0, session_replica_id="gone").reason == "load"


def test_the_ledger_counts_sends_until_the_replica_reports_them() -> None:
    inflight = InFlight()
    before = _replica("a", age_s=1.0)
    sent = inflight.record(before, blocks=5, prompt_tokens=70, block_hashes=[11, 12, 13])
    inflight.record(before, blocks=2, prompt_tokens=30, block_hashes=[])
    assert inflight.promised(before) == (7, 100)
    inflight.cancel(sent)
    assert inflight.promised(before) == (2, 30), "a failed request takes nothing there"
    time.sleep(0.15)
    assert inflight.promised(_replica("a")) == (0, 0), "a later report includes them"


def test_the_ledger_remembers_prefixes_it_sent_for_the_requests_that_follow() -> None:
    inflight = InFlight()
    inflight.record(_replica("a"), 1, 10, [11, 12, 13])
    inflight.record(_replica("b"), 1, 10, [11, 12, 99])
    assert inflight.matched_blocks([11, 12, 13, 14], ["a", "b", "c"]) == {"a": 3, "b": 2, "c": 0}
    assert inflight.matched_blocks([21, 12, 13], ["a", "b"]) == {"a": 0, "b": 0}, "matched from the first block on"


def test_the_fleets_index_counts_each_replicas_prefix_up_to_its_first_missing_block() -> None:
    index = ModelIndex()
    index.store("a", [1, 2, 3])
    index.store("b", [1, 3])  # evicted block 2: its block 3 is no use to this prompt
    index.store("c", [2, 3])
    everyone = ["a", "b", "c", "d"]
    assert index.matched_blocks([1, 2, 3, 4], everyone) == {"a": 3, "b": 1, "c": 0, "d": 0}
    assert index.matched_blocks([1, 2], everyone) == {"a": 2, "b": 1, "c": 0, "d": 0}
    assert index.matched_blocks([], everyone) == dict.fromkeys(everyone, 0)
    assert index.matched_blocks([1, 2, 3], ["b"]) == {"b": 1}, "only the candidates asked about"


def test_for_a_state_model_the_ledger_counts_a_sent_prefix_only_to_where_a_prompt_ended() -> None:
    """A replica of a model with state layers resumes a prompt only from a state snapshot,
    which it keeps where each prompt it computed ended (the last of its block hashes): a
    prefix sent inside a longer prompt counts for an attention model's replica, not for a
    state model's, until it expires."""
    now = [1000.0]
    inflight = InFlight(clock=lambda: now[0])
    for replica, hashes in (("a", [11, 12, 13]), ("b", [11, 12, 13]), ("b", [11])):
        inflight.record(_replica(replica), 1, 10, hashes)
    both = frozenset({"a", "b"})
    assert inflight.matched_blocks([11, 12, 14], ["a", "b"], both) == {"a": 0, "b": 1}
    assert inflight.matched_blocks([11, 12, 14], ["a", "b"]) == {"a": 2, "b": 2}
    assert inflight.matched_blocks([11, 12, 13, 15], ["a", "b"], both) == {"a": 3, "b": 3}
    now[0] += PENDING_PREFIX_S + 1
    assert inflight.matched_blocks([11, 12, 13], ["a", "b"], both) == {"a": 0, "b": 0}


def test_room_is_ranked_in_the_tokens_a_request_can_still_take() -> None:
    """A replica of a sliding-window model publishes `free_tokens` beyond its raw blocks (its
    sliding layers hold only their window): the gateway ranks room on that."""
    raw = Candidate(_replica("a", free=120))
    grouped_record = _replica("b", free=60).model_copy(update={"free_tokens": 60 * 16 * 3})
    assert grouped_record.room_blocks == 180 and raw.replica.room_blocks == 120
    decision = decide([raw, Candidate(grouped_record)], PROMPT, saturation_s=1.0)
    assert decision.replica.replica_id == "b"


def test_a_state_model_replica_without_a_free_state_slot_has_no_room() -> None:
    """A model with state layers runs one sequence per state slot: a replica whose slots
    are all taken queues a new request whatever its free blocks, so it ranks below one
    with a slot to spare."""
    full = _replica("a", free=180).model_copy(update={"free_state_slots": 0, "total_state_slots": 8})
    spare = _replica("b", free=40).model_copy(update={"free_state_slots": 1, "total_state_slots": 8})
    assert (full.room_blocks, spare.room_blocks) == (0, 40)
    assert decide([Candidate(full), Candidate(spare)], PROMPT, saturation_s=1.0).replica.replica_id == "b"
