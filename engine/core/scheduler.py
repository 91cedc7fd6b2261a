"""Continuous batching: every step mixes running decodes with new or chunked prefills.

Requests are served first come, first served. When a running request needs a block and
none is free, the most recently admitted request is preempted (recompute: its blocks are
freed and its tokens computed again later; swap: its blocks move to host memory), and it
resumes, in arrival order, when blocks free up. No waiting request is admitted in a step
that preempted, so the oldest requests always finish first.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.core.kv_cache_manager import KVCacheManager, PendingCopies, PrefixHit
from pagefleet.engine.core.request import Request, RequestStatus, Sequence
from pagefleet.engine.kv_connector.base import KVConnector
from pagefleet.engine.kv_transfer.params import RemoteKV
from pagefleet.engine.lora.manager import LoRAManager
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.spec_decode.speculator import Speculator

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of `seq` from position `start` (its computed-token count when
    scheduled), to be written into `block_tables` (one per KV cache group): all a forward
    pass needs to know. With speculation, the last `len(draft_token_ids)` of them are
    drafts that follow the sequence's own tokens (verified after the pass, kept only if
    accepted)."""

    request: Request
    seq: Sequence
    start: int
    num_new_tokens: int
    block_tables: list[list[int]]
    draft_token_ids: list[int] = field(default_factory=list)
    state_slot: int | None = None  # its state-cache slot (models with state layers)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def num_own_tokens(self) -> int:
        """The sequence's own tokens in the chunk (the drafts excluded)."""
        return self.num_new_tokens - len(self.draft_token_ids)

    @property
    def input_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_own_tokens] + self.draft_token_ids


@dataclass(slots=True)
class SampleRequest:
    chunk_index: int  # sample from the logits after this chunk's last own token
    seq: Sequence  # who samples: the chunk's own sequence, or a sibling forking from it
    params: SamplingParams
    draft_token_ids: list[int] = field(default_factory=list)  # to verify at the chunk's next rows


@dataclass(slots=True)
class SchedulePlan:
    """A step's work, ready for the runner and then for the step's update:

    - `chunks` in batch order (single-token chunks, decodes, first, as the attention batch
      lays them out; within each kind the chunks of one LoRA adapter side by side, so its
      rows form one run);
    - `samples`: who samples after which chunk (siblings at their fork point sample from
      sequence 0's logits);
    - `prompt_logprob_chunks`: the chunks whose prompt logprobs are computed;
    - `forks`: the chunks that reach their request's fork point (once computed, the
      request's other sequences share their blocks);
    - the requests preempted to make room, and the block copies to run first.
    """

    chunks: list[ScheduledChunk] = field(default_factory=list)
    samples: list[SampleRequest] = field(default_factory=list)
    prompt_logprob_chunks: list[int] = field(default_factory=list)
    forks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: PendingCopies = field(default_factory=PendingCopies)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions_recompute: int = 0
    num_preemptions_swap: int = 0


class Scheduler:
    """Decides each step's work and owns every request's status, adapter slot, fork state
    and trace events.

    Contract:
    - `add` queues a request (WAITING) in arrival order; `finish` takes it out wherever it
      is, frees every block it holds (device or host) and marks it FINISHED.
    - `schedule` returns the step's plan (chunks, samples, forks, block copies). It only
      allocates through the KV cache manager, and a request is either scheduled with every
      block it needs or not at all. Running requests come first, in admission order; when
      one cannot get its blocks the newest running request is preempted (recompute: its
      blocks freed, it waits again; swap: its blocks moved to host memory). Waiting requests
      are admitted strictly in arrival order, and none in a step that preempted.
    - With a speculator, a decoding sequence's chunk may carry draft tokens after its last
      token, as many as the load switch allows this step and only if their slots are free
      (drafts never preempt), and never past a LongRoPE model's pretraining length.
    - A request of a LongRoPE model whose sequences outgrow the pretraining length is
      computed again from its first token, rotated by the long factors (as transformers
      does: engine/layers/rotary.py); it gives back its blocks and waits at its place in
      the queue.
    - Invariant: at most `max_num_batched_tokens` tokens and `max_num_seqs` sequences a step.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache: KVCacheManager,
        lora: LoRAManager | None = None,
        speculator: Speculator | None = None,
        kv_connector: KVConnector | None = None,
        long_rope_after: int | None = None,
    ) -> None:
        self.config = config
        self.long_rope_after = long_rope_after  # LongRoPE's pretraining length, if the model has one
        self.kv_cache = kv_cache
        self.kv_connector = kv_connector or KVConnector()
        self.lora = lora
        self.speculator = speculator
        self._draft_length = 0  # this step's drafts per sequence (the load switch's choice)
        self.waiting: list[Request] = []  # sorted by arrival_index
        self.running: list[Request] = []  # in admission order
        self.stats = SchedulerStats()

    @property
    def num_running_seqs(self) -> int:
        return sum(r.num_seq_slots for r in self.running)

    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.arrival_index)

    def finish(self, request: Request) -> None:
        """Drop a finished, failed or aborted request and free every block it holds."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free_blocks(request)
        self._release_adapter(request)
        self.kv_connector.drop_staged(request)
        request.status = RequestStatus.FINISHED

    def _free_blocks(self, request: Request) -> None:
        """Every block the request holds, on the device or (swapped out) on the host."""
        if request.status == RequestStatus.SWAPPED:
            self.kv_cache.release_host_blocks(request)
        else:
            self.kv_cache.free_request(request)

    def schedule(self) -> SchedulePlan:
        plan = SchedulePlan()
        if self.speculator is not None:
            self._draft_length = self.speculator.draft_length(len(self.running))
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        plan.copies = self.kv_cache.pending.take()
        plan.chunks.sort(key=_batch_order)
        for index, chunk in enumerate(plan.chunks):
            request = chunk.request
            if chunk.seq.index == 0 and chunk.start < request.num_prompt_tokens:
                request.note("prefill_chunk", start=chunk.start, tokens=chunk.num_new_tokens)
            if request.wants_prompt_logprobs:
                plan.prompt_logprob_chunks.append(index)
            if request.reaches_fork_point(chunk.end):
                # Every sibling with no token of its own yet samples from the same logits
                # as sequence 0; the step's update shares sequence 0's blocks with them.
                siblings = [seq for seq in request.sequences if seq.num_tokens == chunk.end]
                plan.samples += [SampleRequest(index, seq, request.params) for seq in siblings]
                plan.forks.append(chunk)
                request.mark_forked()
            elif request.fork_point is None and chunk.start + chunk.num_own_tokens == chunk.seq.num_tokens:
                plan.samples.append(SampleRequest(index, chunk.seq, request.params, chunk.draft_token_ids))
        return plan

    # --- phases -------------------------------------------------------------------------

    def _schedule_running(self, plan: SchedulePlan, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._outgrew_short_rope(request):
                self.running.remove(request)
                self._rotate_long(request)
                self.add(request)
                continue
            scheduled = self._try_schedule_request(request, plan, budget)
            while scheduled is None:
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is request:
                    break
                scheduled = self._try_schedule_request(request, plan, budget)
            if scheduled is None:
                break  # the request preempted itself; everything after it is gone too
            budget -= scheduled
            index += 1
        return budget

    def _schedule_waiting(self, plan: SchedulePlan, budget: int) -> None:
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if self._outgrew_short_rope(request):  # it was preempted right after it outgrew them
                self._rotate_long(request)
            if self.num_running_seqs + request.num_seq_slots > self.config.max_num_seqs:
                break
            if not self._hold_adapter(request):
                break  # every adapter slot is held by running requests of other adapters
            starts_afresh = request.status == RequestStatus.WAITING and not self.kv_cache.holds_blocks(
                request.sequences[0]
            )
            if starts_afresh and self.kv_connector.is_loading(request):
                self._release_adapter(request)
                break  # strict FCFS: the head waits for its KV from outside
            hit = self._local_hits(request) if starts_afresh else None
            remote = self._external_prefix(request, hit) if starts_afresh else None
            if request.status == RequestStatus.SWAPPED:
                if not self._try_swap_in(request):
                    self._release_adapter(request)
                    break
            elif remote is not None:
                if not self.kv_cache.take_remote_prefix(request.sequences[0], remote):
                    self._release_adapter(request)
                    break
                if remote.origin != "prefill":
                    self._count_prefix(request, remote.num_tokens, local_hit_tokens=0)
            elif hit is not None:
                self._take_prefix_hits(request, hit)
            scheduled = self._try_schedule_request(request, plan, budget)
            if scheduled is None:
                if starts_afresh:
                    self.kv_cache.free(request.sequences[0])  # give back prefix hits or remote blocks
                self._release_adapter(request)
                break  # strict FCFS: a later request may not overtake the head of the queue
            if remote is not None:
                self.kv_cache.queue_load(request.sequences[0], remote)
            if starts_afresh:
                # Loaded once, or the local cache had as much: a recompute computes it here.
                self.kv_connector.drop_staged(request)
            self.waiting.pop(0)
            resumed = any(event.name == "preempted" for event in request.events)
            request.note("scheduled", cached_tokens=request.num_cached_tokens, resumed=resumed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= scheduled

    def _hold_adapter(self, request: Request) -> bool:
        """Its adapter in a slot (loaded now if it must be); False if no slot is free."""
        if request.lora_request is None or request.lora_slot is not None or self.lora is None:
            return True
        request.lora_slot = self.lora.acquire(request.lora_request.lora_name)
        return request.lora_slot is not None

    def _release_adapter(self, request: Request) -> None:
        if request.lora_slot is not None and self.lora is not None:
            self.lora.release(request.lora_slot)
            request.lora_slot = None

    def _local_hits(self, request: Request) -> PrefixHit | None:
        """What the prefix cache holds of the request's first sequence (`find_prefix_hits`);
        None with prompt logprobs (skipped positions would have none). Hits stop short of
        the target: its last token is always computed, so the step that reaches the fork
        point really runs."""
        if request.prompt_logprobs is not None:
            return None
        seq = request.sequences[0]
        return self.kv_cache.find_prefix_hits(seq, request.compute_target(seq))

    def _take_prefix_hits(self, request: Request, hit: PrefixHit) -> None:
        usable = hit.num_blocks > 0 and hit.cost <= self.kv_cache.num_free_blocks
        hit_tokens = hit.num_blocks * self.kv_cache.block_size if usable else 0
        self._count_prefix(request, hit_tokens, hit_tokens)
        if usable:
            self.kv_cache.take_cached_prefix(request.sequences[0], hit)

    def _count_prefix(self, request: Request, cached_tokens: int, local_hit_tokens: int) -> None:
        """Count a request's prompt once, not per retry: `cached_tokens` came from any
        tier, `local_hit_tokens` of them from this replica's prefix cache."""
        if not request.is_prefix_counted:
            request.is_prefix_counted = True
            request.num_cached_tokens = cached_tokens
            self.kv_cache.record_prefix_lookup(request.num_prompt_tokens, local_hit_tokens)

    def _external_prefix(self, request: Request, hit: PrefixHit | None) -> RemoteKV | None:
        """The connectors' KV for the request's first tokens, if it covers more than the
        local prefix cache's `hit` (a prefill replica's always)."""
        local_tokens = hit.num_blocks * self.kv_cache.block_size if hit is not None else 0
        return self.kv_connector.external_prefix(request, local_tokens)

    def _try_swap_in(self, request: Request) -> bool:
        needed = self.kv_cache.swap_in_cost(request) + len(request.active_sequences)
        if needed > self.kv_cache.num_free_blocks:
            return False
        self.kv_cache.swap_in(request)
        request.status = RequestStatus.WAITING  # back on the device, admitted below
        return True

    def _try_schedule_request(self, request: Request, plan: SchedulePlan, budget: int) -> int | None:
        """Allocate slots for the request's next tokens; None (nothing changed) if blocks
        run out. Returns the number of tokens scheduled."""
        if self._draft_length and budget > 1:
            speculated = self._try_speculate(request, plan, budget)
            if speculated:
                return speculated
        wanted = []
        reaches_end = []
        for seq in request.active_sequences:
            start = self.kv_cache.num_computed_tokens(seq)
            remaining = request.compute_target(seq) - start
            num_new = self.kv_cache.chunk_end(seq, start, start + min(remaining, budget)) - start
            reaches_end.append(num_new == remaining)
            if num_new > 0:
                wanted.append((seq, num_new))
                budget -= num_new
        if request.beam is not None and request.is_forked and not all(reaches_end):
            # Beams pick their next tokens together, from logits of the same step: a beam
            # whose last token fits keeps it back until every beam's does.
            wanted = [
                (seq, n - 1) if n == request.compute_target(seq) - self.kv_cache.num_computed_tokens(seq) else (seq, n)
                for seq, n in wanted
            ]
            wanted = [(seq, n) for seq, n in wanted if n > 0]
        needed = sum(self.kv_cache.blocks_needed(seq, n) for seq, n in wanted)
        if needed > self.kv_cache.num_free_blocks:
            return None
        for seq, num_new in wanted:
            start = self.kv_cache.num_computed_tokens(seq)
            allocated = self.kv_cache.allocate_slots(seq, num_new)
            assert allocated is not None, "blocks_needed said the slots were free"
            tables, state_slot = self.kv_cache.block_tables(seq), self.kv_cache.state_slot(seq)
            plan.chunks.append(ScheduledChunk(request, seq, start, num_new, tables, state_slot=state_slot))
        return sum(n for _, n in wanted)

    def _try_speculate(self, request: Request, plan: SchedulePlan, budget: int) -> int:
        """A decoding sequence's next token with drafts after it, if the speculator has any
        and their slots are free (drafts never preempt anyone); 0 if not scheduled."""
        assert self.speculator is not None
        seq = request.sequences[0]
        start = self.kv_cache.num_computed_tokens(seq)
        if not self.speculator.can_speculate(request) or seq.num_tokens - start != 1:
            return 0
        limit = min(self._draft_length, budget - 1)
        if self.long_rope_after is not None and not request.rotates_long:
            limit = min(limit, self.long_rope_after - seq.num_tokens)  # no draft past the switch
        drafts = self.speculator.propose(request, seq, limit) if limit > 0 else []
        if not drafts or self.kv_cache.blocks_needed(seq, 1 + len(drafts)) > self.kv_cache.num_free_blocks:
            return 0
        allocated = self.kv_cache.allocate_slots(seq, 1 + len(drafts))
        assert allocated is not None, "blocks_needed said the slots were free"
        tables = self.kv_cache.block_tables(seq)
        plan.chunks.append(ScheduledChunk(request, seq, start, 1 + len(drafts), tables, drafts))
        return 1 + len(drafts)

    def _outgrew_short_rope(self, request: Request) -> bool:
        """Whether the request's keys rotate by LongRoPE's short factors while a sequence
        of it is now longer than the pretraining length."""
        after = self.long_rope_after
        return (
            after is not None
            and not request.rotates_long
            and any(seq.num_tokens > after for seq in request.active_sequences)
        )

    def _rotate_long(self, request: Request) -> None:
        """Give back every block of the request's (computed with the short factors) and
        switch it to the long ones: it waits to be computed again from its first token."""
        self._free_blocks(request)
        self._release_adapter(request)
        request.reset_fork()
        request.status = RequestStatus.WAITING
        request.rotate_long()
        request.note("long_rope_recompute")
        logger.info("request %s outgrew LongRoPE's short factors: computed again with the long", request.request_id)

    def _preempt(self, request: Request, plan: SchedulePlan) -> None:
        self.running.remove(request)
        plan.chunks = [c for c in plan.chunks if c.request is not request]
        swap = self.config.preemption_mode == "swap" and self.kv_cache.can_swap_out(request)
        if swap:
            self.kv_cache.swap_out(request)
            request.status = RequestStatus.SWAPPED
            self.stats.num_preemptions_swap += 1
        else:
            self.kv_cache.free_request(request)
            request.reset_fork()
            request.status = RequestStatus.WAITING
            self.stats.num_preemptions_recompute += 1
        self._release_adapter(request)
        mode = "swap" if swap else "recompute"
        request.note("preempted", mode=mode)
        logger.info("preempted request %s by %s", request.request_id, mode)
        plan.preempted.append(request)
        self.add(request)


def _batch_order(chunk: ScheduledChunk) -> tuple[bool, int]:
    """Decodes first (with their drafts: each draft row attends as a decode, see
    ModelRunner._build_batch); then by adapter slot, the base model's first (no slot)."""
    slot = chunk.request.lora_slot
    return chunk.num_own_tokens != 1, -1 if slot is None else slot
