"""The synchronous engine core: add requests, `step()` them forward, read outputs.

One step = schedule -> run block copies -> forward pass and sampling -> bookkeeping
(progress, forks, prefix-cache registration, detokenization, stop checks, freeing).
`LLM` drives it in a loop; `AsyncEngine` drives it from a background thread. What a
request is checked and prepared with before it enters lives in request_checks.py.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from pagefleet.engine.beam_search import BeamSearchState
from pagefleet.engine.config import EngineConfig
from pagefleet.engine.detokenizer import Detokenizer
from pagefleet.engine.engine_setup import build_engine_parts
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.inputs import PreparedPrompt, PromptType
from pagefleet.engine.kv_transfer.connector import KVConnector
from pagefleet.engine.kv_transfer.params import KVLayout, KVTransferError, RemoteKV
from pagefleet.engine.kv_transfer.pins import PinnedPrompt, PinnedPrompts
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.model_runner import RequestResults, SampleRequest
from pagefleet.engine.output_processor import OutputProcessor
from pagefleet.engine.outputs import RequestOutput
from pagefleet.engine.request import Request, RequestStatus, Sequence
from pagefleet.engine.request_checks import RequestChecks
from pagefleet.engine.sampler import SampleResult
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import ScheduledChunk
from pagefleet.engine.stats import EngineStats
from pagefleet.protocol.block_hash import chain_root

logger = logging.getLogger(__name__)

_MIN_MEASURED_PREFILL_TOKENS = 64


def prefix_hash_root(lora_request: LoRARequest | None, cache_salt: str | None) -> int:
    """The first link of a request's prefix-cache hash chain: an adapter's KV, or a salted
    request's, is its own (protocol/block_hash.py; routers compute the same)."""
    return chain_root(lora_request.lora_name if lora_request is not None else None, cache_salt)


class LLMEngine:
    """The engine core, driven one `step()` at a time by one thread.

    Contract:
    - `add_request` validates a request completely (a bad one raises InvalidParameterError
      and changes nothing) and queues it; `abort_request` ends one now.
    - `step()` runs one scheduled batch and returns an output for every request it touched;
      a finished request's output has `finished=True` and is the last for that request.
    - A request that fails inside the step (its sampling, its prompt logprobs, its
      bookkeeping) finishes alone with finish_reason "error"; the others run on.
    - Invariant: a request that finishes, fails or is aborted holds no block afterwards.
    Reads only: request state belongs to the output processor (tokens and stop state), the
    scheduler (status) and the KV cache manager (blocks and progress).
    """

    def __init__(self, config: EngineConfig, kv_connector: KVConnector | None = None) -> None:
        self.config = config
        self.parts = build_engine_parts(config)
        self.tokenizer = self.parts.tokenizer
        self.max_model_len = self.parts.max_model_len
        model_config = self.parts.model_config
        self.max_logprobs = model_config.vocab_size if config.max_logprobs == -1 else config.max_logprobs
        self.kv_cache = self.parts.kv_cache
        self.scheduler = self.parts.scheduler
        self.runner = self.parts.runner
        self.lora = self.parts.lora
        self.outputs = OutputProcessor(
            Detokenizer(self.tokenizer), self.parts.model_config.eos_token_ids, self.max_model_len
        )
        self.requests: dict[str, Request] = {}
        self.checks = RequestChecks(
            self.tokenizer,
            model_config.vocab_size,
            model_config.eos_token_ids,
            self.max_model_len,
            self.max_logprobs,
            self.kv_cache.block_size,
            self.kv_cache.num_blocks,
            config.kv_role,
        )
        self._arrivals = itertools.count()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self.last_step_tokens = 0  # tokens the latest step computed (prompt chunks and decodes)
        self._prefill_tokens_per_s = 0.0  # measured (_measure_prefill); 0 until a prefill ran
        # Prefill/decode disaggregation: prompts kept for decode replicas to pull, and how
        # they reach this replica (the server's; without one, answers name no address).
        self.pins = PinnedPrompts(self.kv_cache.pool.free, config.kv_pin_timeout)
        self.kv_connector = kv_connector

    # --- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | PreparedPrompt,
        params: SamplingParams,
        remote_kv: RemoteKV | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Validate and queue a request; `prompt` in any shape of `inputs.PromptType`, or
        prepared ahead (`prepare_prompt`, `with_bad_words_tokenized`: what an engine thread
        should not spend its time on).
        `remote_kv`: its prompt's KV pulled from a prefill replica (a decode replica's
        request); `params.extra_args["kv_transfer_params"]` with `do_remote_decode` makes it
        a prefill replica's request, whose prompt blocks stay pinned for a pull.
        `lora_request`: the adapter to run with (the engine needs enable_lora=True).

        Raises:
            InvalidParameterError: (ValueError) naming the field, e.g. an empty prompt or a
                prompt longer than max_model_len.
        """
        if request_id in self.requests:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        if self.tokenizer is None and params.stop:
            raise InvalidParameterError(
                "stop", "this engine has no tokenizer (skip_tokenizer_init=True): use token ids"
            )
        checks = self.checks
        prepared = prompt if isinstance(prompt, PreparedPrompt) else checks.prepare_prompt(prompt, params)
        text, token_ids, cache_salt = prepared.text, prepared.token_ids, prepared.cache_salt
        checks.validate_prompt(token_ids)
        checks.check_kv_role(params, remote_kv, token_ids)
        self.add_lora(lora_request)
        params = checks.with_bad_words_tokenized(params)
        checks.check_token_constraints(params)
        grammar = checks.compile_grammar(params)
        max_tokens = checks.resolve_max_tokens(len(token_ids), params)
        request = Request(
            request_id,
            text,
            token_ids,
            params,
            next(self._arrivals),
            max_tokens,
            shares_prompt=self.config.enable_block_sharing,
        )
        if lora_request is not None:
            request.lora_request = lora_request
        if lora_request is not None or cache_salt is not None:
            for seq in request.sequences:
                seq.hash_root = prefix_hash_root(lora_request, cache_salt)
        if remote_kv is not None and request.prompt_logprobs is None:
            request.remote_kv = remote_kv  # prompt logprobs need the prompt computed here
        if params.use_beam_search:
            request.beam = BeamSearchState(params, max_tokens, self._stop_token_ids(params))
        if grammar is not None:
            for seq in request.sequences:
                seq.grammar = checks.matcher(grammar)
        if request.remote_kv is None:
            hits, _ = self.kv_cache.find_prefix_hits(request.sequences[0], len(token_ids))
            request.num_expected_prefill_tokens = len(token_ids) - len(hits) * self.kv_cache.block_size
        self.outputs.start(request)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self._num_prompt_tokens += len(token_ids)
        return request

    def add_lora(self, lora_request: LoRARequest | None) -> bool:
        """Read the adapter from disk if it is new (callers may do it ahead, off the lock);
        True, as vLLM's, once it can serve requests.

        Raises:
            InvalidParameterError: LoRA is off, or the adapter cannot be served.
        """
        if lora_request is None:
            return False
        if self.lora is None:
            raise InvalidParameterError("lora_request", "LoRA is off: start the engine with enable_lora=True")
        self.lora.add(lora_request)
        return True

    def remove_lora(self, lora: str | int) -> bool:
        """Forget an adapter, by name or by `lora_int_id` (running requests finish with it);
        False if it was not loaded."""
        return self.lora.remove(lora) if self.lora is not None else False

    def list_loras(self) -> list[str]:
        return self.lora.loaded() if self.lora is not None else []

    def prepare_prompt(self, prompt: PromptType, params: SamplingParams) -> PreparedPrompt:
        """`prompt` tokenized and truncated as its request will compute it (any thread)."""
        return self.checks.prepare_prompt(prompt, params)

    def prompt_token_ids(self, prompt: PromptType, params: SamplingParams) -> list[int]:
        """The token ids the engine computes for `prompt` (any thread)."""
        return self.checks.prompt_token_ids(prompt, params)

    def with_bad_words_tokenized(self, params: SamplingParams) -> SamplingParams:
        """`params`, or a copy with its bad words tokenized (any thread)."""
        return self.checks.with_bad_words_tokenized(params)

    def compile_grammar(self, params: SamplingParams) -> Any:
        """The compiled structured-output constraint of `params`, cached (any thread)."""
        return self.checks.compile_grammar(params)

    def kv_layout(self) -> KVLayout:
        """What a KV transfer with this replica must agree on."""
        model = self.parts.model_config
        return KVLayout(
            model=self.config.model,
            num_layers=model.num_layers,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            block_size=self.kv_cache.block_size,
            dtype=str(self.config.torch_dtype).removeprefix("torch."),
        )

    def checkout_pinned(self, request_id: str, block_ids: list[int]) -> PinnedPrompt:
        """A pinned prompt for a pull to read (expiry spares it until released or checked
        in); the asked blocks must be its first ones.

        Raises:
            KVTransferError: unknown, expired, already pulled, or other blocks.
        """
        pinned = self.pins.checkout(request_id)
        if pinned is None:
            raise KVTransferError(f"no KV is pinned for request {request_id!r} (already pulled, or timed out)")
        if pinned.block_ids[: len(block_ids)] != block_ids:
            self.pins.checkin(request_id)
            raise KVTransferError(f"request {request_id!r} holds blocks {pinned.block_ids}, not {block_ids}")
        return pinned

    def read_blocks(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the blocks' keys and values, layer by layer (safe beside a running
        step only for pinned blocks: nothing writes them)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.runner.device)
        return [(k[index].cpu(), v[index].cpu()) for k, v in self.runner.kv_caches]

    def expire_pins(self) -> int:
        """Free the prompts no decode replica pulled in time."""
        return self.pins.expire() if len(self.pins) else 0

    def _stop_token_ids(self, params: SamplingParams) -> set[int]:
        eos = set() if params.ignore_eos else set(self.parts.model_config.eos_token_ids)
        return eos | set(params.stop_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.outputs.finish_unfinished(request, "abort")
        self.scheduler.finish(request)
        return self.outputs.make_output(request)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's): only while no block is in use; False
        (and nothing changed) otherwise."""
        return self.kv_cache.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected
        or the process exits); the engine cannot step afterwards."""
        if self.runner.workers is not None:
            self.runner.workers.stop()

    # --- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Two calls: the scheduler's plan (chunks in batch order, block copies) runs on the
        runner, then `_update` applies what it returned."""
        self.expire_pins()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return self._fail_unschedulable()
        chunks = plan.chunks
        prompt_chunks = [i for i, c in enumerate(chunks) if c.request.wants_prompt_logprobs]
        started = time.monotonic()
        results = self.runner.execute(chunks, self._plan_samples(chunks), prompt_chunks, plan.copies)
        return self._update(chunks, results, started)

    def _update(
        self, chunks: list[ScheduledChunk], results: dict[str, RequestResults], started: float
    ) -> list[RequestOutput]:
        """The step's writes: computed tokens and forks (`_advance`), the prefill rate, then
        each request's tokens or beams, stops, pins and freed blocks, request by request."""
        self.last_step_tokens = sum(c.num_new_tokens for c in chunks)
        touched = self._advance(chunks)
        now = time.monotonic()
        self._measure_prefill(sum(c.num_new_tokens for c in chunks if c.num_new_tokens > 1), now - started)
        outputs = []
        for request in touched:
            # Each request's own work runs apart: if it raises, that request fails alone.
            try:
                request_results = results.get(request.request_id)
                if request_results is not None:
                    self._apply_results(request, request_results, now)
                outputs.append(self._after_step(request))
            except Exception as error:  # a per-request boundary: fail it, free its blocks
                outputs.append(self._fail_request(request, error))
        return outputs

    def _measure_prefill(self, num_prompt_tokens: int, seconds: float) -> None:
        """Keep a moving average of prompt tokens computed per second (the fleet's routers
        judge how long this replica's queue of prompts takes from it). Steps with few prompt
        tokens say more about decoding than prefill and are left out."""
        if num_prompt_tokens < _MIN_MEASURED_PREFILL_TOKENS or seconds <= 0:
            return
        rate = num_prompt_tokens / seconds
        self._prefill_tokens_per_s = (
            rate if not self._prefill_tokens_per_s else 0.8 * self._prefill_tokens_per_s + 0.2 * rate
        )

    def _apply_results(self, request: Request, results: RequestResults, now: float) -> None:
        """This request's part of the step: prompt logprobs, then its new tokens or beams."""
        if results.error is not None:
            raise results.error
        if results.prompt_logprobs is not None:
            self.outputs.add_prompt_logprobs(request, results.prompt_logprobs)
        if results.sampled is None:
            return
        request.first_token_time = request.first_token_time or now
        if request.beam is not None:
            rows = {id(sample.seq): row for sample, row in zip(results.samples, results.rows, strict=True)}
            self._step_beams(request, rows, results.sampled)
            return
        for sample, row in zip(results.samples, results.rows, strict=True):
            self.outputs.append_token(request, sample.seq, results.sampled, row)
            self._num_generation_tokens += 1

    def _fail_request(self, request: Request, error: Exception) -> RequestOutput:
        """End `request` with finish reason "error", free its blocks, and say why."""
        logger.error("request %s failed; the other requests run on", request.request_id, exc_info=error)
        request.error = f"{type(error).__name__}: {error}"
        self.outputs.finish_unfinished(request, "error")
        self.requests.pop(request.request_id, None)
        self.scheduler.finish(request)
        return self.outputs.make_output(request)

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """With nothing running, every block is free: a waiting request that still cannot
        be scheduled never will be. Fail it rather than wait forever (add_request's checks
        should make this unreachable)."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        request = self.scheduler.waiting[0]
        logger.error("request %s cannot fit the KV cache even alone; failing it", request.request_id)
        output = self.abort_request(request.request_id)
        return [output] if output is not None else []

    def _plan_samples(self, chunks: list[ScheduledChunk]) -> list[SampleRequest]:
        samples = []
        for index, chunk in enumerate(chunks):
            request, seq = chunk.request, chunk.seq
            if request.fork_point is not None:
                # At the fork point every sibling that has no tokens of its own yet samples
                # from the same logits as sequence 0.
                if request.reaches_fork_point(chunk.end):
                    samples += [
                        SampleRequest(index, s, request.params) for s in request.sequences if s.num_tokens == chunk.end
                    ]
            elif chunk.end == seq.num_tokens:
                samples.append(SampleRequest(index, seq, request.params))
        return samples

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
        for beam in beams:
            if not any(child is beam for child in children):
                self.kv_cache.free(beam)
        self.outputs.extend_beams(children, continuations)
        request.sequences = children
        self._num_generation_tokens += len(beams)

    def _advance(self, chunks: list[ScheduledChunk]) -> list[Request]:
        touched: dict[str, Request] = {}
        for chunk in chunks:
            computed = self.kv_cache.commit(chunk.seq, chunk.num_new_tokens)
            request = chunk.request
            touched[request.request_id] = request
            if request.reaches_fork_point(computed):
                for sibling in request.sequences[1:]:
                    self.kv_cache.fork(chunk.seq, sibling)
                request.mark_forked()
        return list(touched.values())

    def _after_step(self, request: Request) -> RequestOutput:
        if request.generation_ended and request.wants_remote_decode:
            self._pin_prompt(request)
        for seq in request.sequences:
            if seq.is_finished and self.kv_cache.block_table(seq):
                self.kv_cache.free(seq)  # siblings still running keep only what they share
        if request.generation_ended:
            self.requests.pop(request.request_id, None)
            self.scheduler.finish(request)
        return self.outputs.make_output(request)

    def _pin_prompt(self, request: Request) -> None:
        """Keep a finished prefill request's prompt blocks for a decode replica's pull, and
        say where to pull them from (vLLM's `kv_transfer_params`)."""
        holder = next((seq for seq in request.sequences if self.kv_cache.block_table(seq)), None)
        if holder is None or self.kv_cache.num_computed_tokens(holder) < request.num_prompt_tokens:
            return
        blocks = self.kv_cache.pin_prompt(holder, request.num_prompt_tokens)
        self.pins.pin(request.request_id, blocks, request.prompt_token_ids)
        if self.kv_connector is not None:
            request.kv_transfer_params = self.kv_connector.transfer_params(request.request_id, blocks)
        else:
            request.kv_transfer_params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": blocks,
                "remote_request_id": request.request_id,
            }

    # --- stats --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        usage, cache_stats, scheduler = self.kv_cache.usage(), self.kv_cache.stats, self.scheduler
        return EngineStats(
            num_total_blocks=usage.num_blocks,
            num_free_blocks=usage.num_free_blocks,
            num_cached_blocks=usage.num_cached_blocks,
            block_size=self.kv_cache.block_size,
            num_running_requests=len(scheduler.running),
            num_waiting_requests=len(scheduler.waiting),
            num_swapped_requests=sum(r.status == RequestStatus.SWAPPED for r in scheduler.waiting),
            num_preemptions_recompute=scheduler.stats.num_preemptions_recompute,
            num_preemptions_swap=scheduler.stats.num_preemptions_swap,
            prefix_cache_queries=cache_stats.prefix_queries,
            prefix_cache_hits=cache_stats.prefix_hits,
            num_cow_copies=cache_stats.cow_copies,
            num_shared_blocks=usage.num_shared_blocks,
            num_blocks_saved_by_sharing=usage.num_blocks_saved_by_sharing,
            peak_used_blocks=usage.peak_used_blocks,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_waiting_prompt_tokens=sum(
                r.num_expected_prefill_tokens for r in scheduler.waiting if r.status == RequestStatus.WAITING
            ),
            num_pinned_blocks=self.pins.num_blocks,
            num_pinned_requests=len(self.pins),
            num_pin_timeouts=self.pins.num_timeouts,
            prefill_tokens_per_s=self._prefill_tokens_per_s,
        )
