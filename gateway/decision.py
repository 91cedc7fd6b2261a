"""The routing decision of the default policy, `affinity`: one pure function, run for every
request by the gateway's proxy and the Envoy picker (through routing.Router), and by
bench/fleet_sim.py over simulated replicas.

The rule keeps the fleet's design, that work lands where there is the most KV room, and
makes it exact per request: a replica that already holds the request's prefix needs neither
the blocks nor the prefill for it. So:

1. affinity: the replica holding the longest cached prefix of the prompt, unless it is
   saturated for this request: its prompt queue would take longer than `saturation_s`,
   or longer than the prefill its cache saves this request (weighted as below), so that a
   short prefix every prompt shares (a chat template's default system prompt) does not
   pull every request onto one replica;
2. saturated: if it is, the replica where it costs least: its prompt queue plus the part
   of this prompt it would have to prefill, weighted by `COLD_PREFILL_WEIGHT`, both at its
   measured rate. A request leaves a busy holder only for a replica that is sooner by
   several times the prefill it would cost there;
3. session: with no cached prefix anywhere, the replica the same session (`x-session-id`,
   else the body's `user`) went to last, unless it is saturated;
4. load: otherwise the best by load.

Load ranks by free blocks net of blocks promised to requests in flight, counting the
request's cached blocks as free (it will not need them), then by a shorter queue. A
replica's queue is its queued uncached prompt tokens (its report's, plus those sent to it
since) and its running requests, each counted as `RUNNING_REQUEST_TOKENS` prompt tokens: a
new prompt shares every step with them. It is saturated when that queue would take longer
than `saturation_s` to prefill at its measured rate, as llm-d's sticky-until-saturated
routing calibrates it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagefleet.protocol.replica import ReplicaRecord

# A replica's prefill rate before it has measured one: SmolLM2-135M on 2 CPU cores computes
# about 2,000 prompt tokens a second (docs/benchmarks.md); a GPU replica soon reports its own.
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
REASONS = ("affinity", "saturated", "session", "load")
# Prefilling the prompt on a replica that does not hold it costs more than this request's
# wait: it delays every request queued behind it there, and it copies a prefix the fleet
# already holds into a second cache, evicting others. Counting that prefill 4 times kept
# bench/fleet_sim.py's goodput highest among 1, 2, 4 and 8 on llm-d's b2b-saas shape short of
# deep overload, while a hot prefix still gets a second home once its holder's queue is long.
COLD_PREFILL_WEIGHT = 4.0
# What one running request adds to a new request's wait, in prompt tokens: on SmolLM2 here a
# short prompt's TTFT grew from 75 ms to 140 ms behind 8 running decodes, about 16 tokens'
# prefill each at 2,000 tokens/s. Without it, a replica busy decoding looked idle, and a
# short prefix every prompt shares (a chat template's default system prompt) drew every
# decode-bound request to one replica.
RUNNING_REQUEST_TOKENS = 16


@dataclass(slots=True, frozen=True)
class Candidate:
    """A replica as one request sees it."""

    replica: ReplicaRecord
    cached_blocks: int = 0  # of this request's prompt, in its prefix cache
    promised_blocks: int = 0  # sent to it since its last report, not yet in its figures
    promised_prompt_tokens: int = 0  # uncached prompt tokens sent to it since its last report

    @property
    def queued_prompt_tokens(self) -> int:
        """Its queue, in prompt tokens: queued uncached prompts, and its running requests."""
        running = RUNNING_REQUEST_TOKENS * self.replica.running
        return self.replica.waiting_prompt_tokens + self.promised_prompt_tokens + running

    def queue_s(self) -> float:
        """Seconds its queue delays a new prompt's prefill."""
        return self.queued_prompt_tokens / (self.replica.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S)

    def cost_s(self, prompt_tokens: int) -> float:
        """Seconds of prefill that sending this request here costs: its queue, then the
        part of the prompt it does not hold, weighted by COLD_PREFILL_WEIGHT."""
        uncached = max(0, prompt_tokens - self.cached_blocks * self.replica.block_size)
        tokens = self.queued_prompt_tokens + COLD_PREFILL_WEIGHT * uncached
        return tokens / (self.replica.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S)

    def is_saturated(self, saturation_s: float) -> bool:
        """Whether its queue outweighs what its cache is worth to this request (see above)."""
        saved_tokens = COLD_PREFILL_WEIGHT * self.cached_blocks * self.replica.block_size
        rate = self.replica.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
        return self.queue_s() > min(saturation_s, saved_tokens / rate)

    def load_rank(self) -> tuple[int, int]:
        """The fleet's one ranking by load, higher is better: KV room for this request, then
        a shorter prompt queue. (reservations.py's script ranks the same way in Redis.)"""
        room = self.replica.room_blocks - self.promised_blocks + self.cached_blocks
        return room, -self.queued_prompt_tokens


@dataclass(slots=True, frozen=True)
class Decision:
    replica: ReplicaRecord
    fallbacks: list[ReplicaRecord]  # every other candidate, best first
    reason: str  # one of REASONS
    cached_blocks: int  # predicted prefix-cache hit on the chosen replica
    holder: ReplicaRecord | None = None  # "saturated": the prefix's holder, which the chosen replica may pull from


def decide(
    candidates: list[Candidate], prompt_tokens: int, saturation_s: float, session_replica_id: str | None = None
) -> Decision:
    """The replica for one request, from at least one candidate.

    Args:
        candidates: the live replicas that may serve it, with what it has cached of the prompt.
        prompt_tokens: the request's prompt length.
        saturation_s: a replica whose queued prompts take longer than this to prefill is not
            chosen for affinity (nor for a session) while another is not saturated.
        session_replica_id: where the request's session went last, if it has one.
    """
    assert candidates, "decide() needs a candidate; the Router returns None without one"
    by_load = sorted(candidates, key=Candidate.load_rank, reverse=True)
    holder = max(by_load, key=lambda c: c.cached_blocks)  # the most cached, then the best by load
    if holder.cached_blocks > 0:
        chosen = holder
        if holder.is_saturated(saturation_s):
            chosen = min(by_load, key=lambda c: c.cost_s(prompt_tokens))  # by_load order breaks ties
        reason = "affinity" if chosen is holder else "saturated"
    else:
        session = next((c for c in by_load if c.replica.replica_id == session_replica_id), None)
        if session is not None and session.queue_s() > saturation_s:
            session = None
        chosen, reason = (session, "session") if session is not None else (by_load[0], "load")
    fallbacks = [c.replica for c in by_load if c is not chosen]
    peer = holder.replica if reason == "saturated" else None
    return Decision(chosen.replica, fallbacks, reason, chosen.cached_blocks, peer)
