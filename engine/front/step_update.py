"""The second half of a step: apply what the runner returned to the engine's requests.

A step is two calls: the scheduler's plan runs on the runner, then `StepUpdate.apply` owns
every write that follows from it: computed tokens (through the KV cache manager), forks at
the fork point, each request's new tokens or beams and stop state (through the output
processor), what the KV connectors keep of finished requests, and retiring them (through
the scheduler).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagefleet.engine.core.kv_cache_manager import KVCacheManager
from pagefleet.engine.core.request import Request, Sequence
from pagefleet.engine.core.scheduler import SampleRequest, SchedulePlan, Scheduler
from pagefleet.engine.front.output_processor import OutputProcessor
from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.kv_connector.base import KVConnector
from pagefleet.engine.sample.sampler import SampleResult
from pagefleet.engine.spec_decode.speculator import Speculator
from pagefleet.engine.worker.model_runner import RequestResults, Verified

logger = logging.getLogger(__name__)

_MIN_MEASURED_PREFILL_TOKENS = 64


@dataclass(slots=True)
class StepCounters:
    """What the steps have done so far, for the engine's statistics."""

    num_generation_tokens: int = 0
    last_step_tokens: int = 0  # tokens the latest step computed (prompt chunks and decodes)
    # vLLM's tokens of an iteration: the prompts whose first token the latest step sampled,
    # plus the tokens it sampled
    last_iteration_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # a moving average; 0 until a prefill was measured


class StepUpdate:
    """The one writer of what a step changes in its requests (see the module docstring).

    A request whose own part fails (its sampling, its prompt logprobs, its bookkeeping)
    finishes alone with finish reason "error" and frees its blocks; the others run on.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        kv_connector: KVConnector,
        counters: StepCounters,
        speculator: Speculator | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.scheduler = scheduler
        self.outputs = outputs
        self.kv_connector = kv_connector
        self.counters = counters
        self.speculator = speculator

    def apply(self, plan: SchedulePlan, results: dict[str, RequestResults], started: float) -> list[RequestOutput]:
        """Computed tokens and forks, the prefill rate, then request by request its tokens
        or beams, stops, what the connectors keep, and freed blocks. Returns an output for
        every request the plan touched that has one to give in its output kind; a finished
        request's is its last."""
        chunks = plan.chunks
        self.counters.last_step_tokens = sum(c.num_new_tokens for c in chunks)
        generated_before = self.counters.num_generation_tokens
        touched = self._commit(plan)
        # vLLM counts a prompt whole, cached part included, in the step of its first token.
        first_tokens = [r for r in touched if r.first_token_time is None and r.request_id in results]
        prompt_tokens = sum(r.num_prompt_tokens for r in first_tokens if results[r.request_id].sampled is not None)
        now = time.monotonic()
        self._measure_prefill(sum(c.num_new_tokens for c in chunks if c.num_own_tokens > 1), now - started)
        if self.speculator is not None and all(c.num_own_tokens == 1 for c in chunks):
            num_draft_chunks = sum(1 for c in chunks if c.draft_token_ids)
            self.speculator.observe_step(self.counters.last_step_tokens, num_draft_chunks, now - started)
        outputs = []
        for request in touched:
            # Each request's own work runs apart: if it raises, that request fails alone.
            try:
                request_results = results.get(request.request_id)
                if request_results is not None:
                    self._apply_results(request, request_results, plan.samples, now)
                output = self._after_step(request)
            except Exception as error:  # a per-request boundary: fail it, free its blocks
                output = self.fail(request, error)
            if output is not None:
                outputs.append(output)
        self.counters.last_iteration_tokens = prompt_tokens + self.counters.num_generation_tokens - generated_before
        return outputs

    def fail(self, request: Request, error: Exception) -> RequestOutput:
        """End `request` with finish reason "error", free its blocks, and say why."""
        logger.error("request %s failed; the other requests run on", request.request_id, exc_info=error)
        request.error = f"{type(error).__name__}: {error}"
        return self.retire(request, "error")

    def retire(self, request: Request, reason: str) -> RequestOutput:
        """End every unfinished sequence of `request` with `reason` ("abort", "error"), free
        its blocks; its final output."""
        self.outputs.finish_unfinished(request, reason)
        self.scheduler.finish(request)
        output = self.outputs.make_output(request)
        assert output is not None, "every output kind gives the final output"
        return output

    def _commit(self, plan: SchedulePlan) -> list[Request]:
        """Every chunk's own tokens computed (drafts wait for verification); at a fork
        point, the siblings share the blocks."""
        touched: dict[str, Request] = {}
        for chunk in plan.chunks:
            # A prefill replica's prompt keeps the window its decode replica's last query reads.
            self.kv_cache.commit(chunk.seq, chunk.num_own_tokens, chunk.request.wants_remote_decode)
            touched[chunk.request.request_id] = chunk.request
        for chunk in plan.forks:
            for sibling in chunk.request.sequences[1:]:
                self.kv_cache.fork(chunk.seq, sibling)
        return list(touched.values())

    def _measure_prefill(self, num_prompt_tokens: int, seconds: float) -> None:
        """Keep a moving average of prompt tokens computed per second (the fleet's routers
        judge how long this replica's queue of prompts takes from it). Steps with few prompt
        tokens say more about decoding than prefill and are left out."""
        if num_prompt_tokens < _MIN_MEASURED_PREFILL_TOKENS or seconds <= 0:
            return
        rate = num_prompt_tokens / seconds
        previous = self.counters.prefill_tokens_per_s
        self.counters.prefill_tokens_per_s = rate if not previous else 0.8 * previous + 0.2 * rate

    def _apply_results(
        self, request: Request, results: RequestResults, samples: list[SampleRequest], now: float
    ) -> None:
        """This request's part of the step (`samples`: the plan's, which its results index):
        prompt logprobs, then its new tokens or beams."""
        if results.error is not None:
            raise results.error
        if results.prompt_logprobs is not None:
            self.outputs.add_prompt_logprobs(request, results.prompt_logprobs)
        if results.sampled is None:
            return
        request.first_token_time = request.first_token_time or now
        seqs = [samples[index].seq for index in results.samples]
        if request.beam is not None:
            rows = {id(seq): row for seq, row in zip(seqs, results.rows, strict=True)}
            self._step_beams(request, rows, results.sampled)
            return
        for index, seq, row in zip(results.samples, seqs, results.rows, strict=True):
            self.outputs.append_token(request, seq, results.sampled, row)
            self.counters.num_generation_tokens += 1
            verified = results.verified.get(index)
            if verified is not None:
                self._take_verified(request, seq, verified)

    def _take_verified(self, request: Request, seq: Sequence, verified: Verified) -> None:
        """The tokens sampled after the accepted drafts, until the sequence stops; the
        accepted drafts among them are computed already (their KV was written in this
        step), the last token emitted is not. Rejected drafts' slots stay uncommitted: the
        next tokens overwrite them, and they never enter the prefix cache."""
        num_before = seq.num_tokens
        for result, row in verified.tokens:
            if seq.is_finished:
                break
            self.outputs.append_token(request, seq, result, row)
            self.counters.num_generation_tokens += 1
        num_emitted = seq.num_tokens - num_before  # after the first token, already counted
        if num_emitted:
            self.kv_cache.commit(seq, num_emitted)
        assert self.speculator is not None, "drafts come from the speculator"
        self.speculator.count(verified.num_drafted, verified.num_accepted)

    def _step_beams(self, request: Request, rows: dict[int, int], result: SampleResult) -> None:
        """One beam-search step: continuations extend their parent beam (the first one
        takes over its sequence, the others fork it and share every block); beams with no
        continuation free their blocks at once."""
        assert request.beam is not None and result.beam_candidates is not None
        beams = request.sequences
        index = torch.tensor([result.beam_rows[rows[id(beam)]] for beam in beams])
        candidates = result.beam_candidates
        continuations = request.beam.step(
            [beam.output_token_ids for beam in beams], candidates.logprobs[index], candidates.token_ids[index]
        )
        # Beams without a continuation go first, so that a request never holds more
        # sequences than its width (a model's state cache has a slot for each).
        parents = {continuation.parent for continuation in continuations}
        for position, beam in enumerate(beams):
            if position not in parents:
                self.kv_cache.free(beam)
        children: list[Sequence] = []
        for continuation in continuations:
            parent = beams[continuation.parent]
            if any(child is parent for child in children):
                child = Sequence(0, list(parent.token_ids), parent.num_prompt_tokens, hash_root=parent.hash_root)
                child.grammar = parent.grammar.fork() if parent.grammar is not None else None
                self.kv_cache.fork(parent, child)
            else:
                child = parent
            children.append(child)
        self.outputs.extend_beams(children, continuations)
        request.sequences = children
        self.counters.num_generation_tokens += len(beams)

    def _after_step(self, request: Request) -> RequestOutput | None:
        if request.generation_ended:
            request.kv_transfer_params = self.kv_connector.request_finished(request, self._prompt_blocks(request))
        for seq in request.sequences:
            if seq.is_finished and self.kv_cache.holds_blocks(seq):
                self.kv_cache.free(seq)  # siblings still running keep only what they share
        if request.generation_ended:
            self.scheduler.finish(request)
            if self.speculator is not None:
                self.speculator.remember(request)
        return self.outputs.make_output(request)

    def _prompt_blocks(self, request: Request) -> list[list[int]]:
        """Per KV cache group, the blocks of a finished request's computed prompt (before
        they are freed), or []."""
        holder = next((seq for seq in request.sequences if self.kv_cache.holds_blocks(seq)), None)
        if holder is None or self.kv_cache.num_computed_tokens(holder) < request.num_prompt_tokens:
            return []
        return self.kv_cache.prompt_blocks(holder, request.num_prompt_tokens)
