"""The synchronous engine core: add requests, `step()` them forward, read outputs.

One step is two calls: the scheduler's plan (chunks in batch order, samples, forks, block
copies) runs on the runner (block copies, forward pass, sampling), then `StepUpdate`
applies the results (progress, forks, prefix-cache registration, detokenization, stop
checks, pins, freeing). `LLM` drives it in a loop; `AsyncEngine` drives it from a
background thread. What a request is checked and prepared with before it enters lives in
request_checks.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

import torch

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.core.request import Request, RequestStatus
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.front.detokenizer import Detokenizer
from pagefleet.engine.front.engine_setup import build_engine_parts
from pagefleet.engine.front.inputs import PreparedPrompt, PromptType
from pagefleet.engine.front.output_processor import OutputProcessor
from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.front.request_checks import RequestChecks
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.front.step_update import StepUpdate
from pagefleet.engine.kv_tiers.cost import TierCost
from pagefleet.engine.kv_tiers.file_store import FileStore
from pagefleet.engine.kv_tiers.file_tier import FileTier
from pagefleet.engine.kv_transfer.connector import KVConnector
from pagefleet.engine.kv_transfer.params import KVLayout, KVTransferError, RemoteKV
from pagefleet.engine.kv_transfer.pins import PinnedPrompt, PinnedPrompts
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.sample.beam_search import BeamSearchState
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.protocol.block_hash import chain_root, reusable_prefix

logger = logging.getLogger(__name__)

_MIN_MEASURED_PREFILL_TOKENS = 64


def prefix_hash_root(lora_request: LoRARequest | None, cache_salt: str | None) -> int:
    """The first link of a request's prefix-cache hash chain: an adapter's KV, or a salted
    request's, is its own (protocol/block_hash.py; routers compute the same)."""
    return chain_root(lora_request.lora_name if lora_request is not None else None, cache_salt)


@dataclasses.dataclass(slots=True, frozen=True)
class _CheckedRequest:
    """A request as `LLMEngine._checked` accepted it."""

    prepared: PreparedPrompt
    params: SamplingParams
    remote_kv: RemoteKV | None
    grammar: Any
    max_tokens: int


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
    Writes only what a request starts with (`add_request`); afterwards its state belongs to
    the scheduler, the KV cache manager and the step's update (see core/request.py).
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
        # Prefill/decode disaggregation: prompts kept for decode replicas to pull, and how
        # they reach this replica (the server's; without one, answers name no address).
        self.pins = PinnedPrompts(self.kv_cache.pool.free, config.kv_pin_timeout)
        self.update = StepUpdate(
            self.kv_cache, self.scheduler, self.outputs, self.pins, kv_connector, self.parts.speculator
        )
        self.tier = self._file_tier(config.kv_cache_dir, int(config.kv_cache_dir_size_gib * (1 << 30)))

    def _file_tier(self, directory: str | None, max_bytes: int) -> FileTier | None:
        if directory is None:
            return None
        self.kv_cache.collect_full_blocks = True
        store = FileStore(directory, self.kv_layout(), max_bytes)
        logger.info("kv file tier: %s (up to %d bytes)", directory, max_bytes)
        counters = self.update.counters
        return FileTier(store, self.kv_cache.pool, self.read_blocks, TierCost(lambda: counters.prefill_tokens_per_s))

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
        checked = self._checked(request_id, prompt, params, remote_kv, lora_request)
        request = self._new_request(request_id, checked, lora_request)
        self.outputs.start(request)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self._num_prompt_tokens += len(request.prompt_token_ids)
        return request

    def _checked(
        self,
        request_id: str,
        prompt: PromptType | PreparedPrompt,
        params: SamplingParams,
        remote_kv: RemoteKV | None,
        lora_request: LoRARequest | None,
    ) -> _CheckedRequest:
        """Everything `add_request` refuses, checked before anything is allocated (the
        adapter, if any, is loaded)."""
        if request_id in self.requests:
            raise InvalidParameterError("request_id", f"{request_id!r} is already running")
        if self.tokenizer is None and params.stop:
            raise InvalidParameterError(
                "stop", "this engine has no tokenizer (skip_tokenizer_init=True): use token ids"
            )
        checks = self.checks
        prepared = prompt if isinstance(prompt, PreparedPrompt) else self.prepare_prompt(prompt, params, lora_request)
        token_ids = prepared.token_ids
        checks.validate_prompt(token_ids)
        if remote_kv is None or remote_kv.origin == "prefill":
            checks.check_kv_role(params, remote_kv, token_ids)
        remote_kv = _longest_prefix(remote_kv, prepared.stored_kv, len(token_ids))
        self.add_lora(lora_request)
        params = checks.with_logprobs_resolved(checks.with_bad_words_tokenized(params))
        checks.check_token_constraints(params)
        grammar = checks.compile_grammar(params)
        max_tokens = checks.resolve_max_tokens(len(token_ids), params)
        return _CheckedRequest(prepared, params, remote_kv, grammar, max_tokens)

    def _new_request(self, request_id: str, checked: _CheckedRequest, lora_request: LoRARequest | None) -> Request:
        prepared, params, remote_kv, max_tokens = (
            checked.prepared,
            checked.params,
            checked.remote_kv,
            checked.max_tokens,
        )
        token_ids, cache_salt = prepared.token_ids, prepared.cache_salt
        request = Request(
            request_id,
            prepared.text,
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
        if checked.grammar is not None:
            for seq in request.sequences:
                seq.grammar = self.checks.matcher(checked.grammar)
        if request.remote_kv is None:
            hits, _ = self.kv_cache.find_prefix_hits(request.sequences[0], len(token_ids))
            request.num_expected_prefill_tokens = len(token_ids) - len(hits) * self.kv_cache.block_size
        elif request.remote_kv.origin != "prefill":
            request.num_expected_prefill_tokens = len(token_ids) - request.remote_kv.num_tokens
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

    def prepare_prompt(
        self, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> PreparedPrompt:
        """`prompt` tokenized and truncated as its request will compute it, with its
        longest prefix from the file tier if reading it beats computing it (any thread)."""
        prepared = self.checks.prepare_prompt(prompt, params)
        if self.tier is None or params.prompt_logprobs is not None:
            return prepared
        root = prefix_hash_root(lora_request, prepared.cache_salt)
        full, hashes = reusable_prefix(prepared.token_ids, self.kv_cache.block_size, root)
        stored = self.tier.read_prefix(hashes, full) if hashes else None
        return prepared if stored is None else dataclasses.replace(prepared, stored_kv=stored)

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

    def count_cached_prefix(self, hashes: list[int], token_ids: list[int]) -> int:
        """How many of the prompt's full blocks this replica has now, in its prefix cache or
        its file tier (any thread: a peek)."""
        local = self.kv_cache.pool.count_cached(hashes, token_ids, self.kv_cache.block_size)
        return max(local, self.tier.store.count_present(hashes)) if self.tier is not None else local

    def peek_cached_prefix(self, hashes: list[int], token_ids: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (full blocks of `token_ids`),
        without a reference (any thread): a step may evict and rewrite them meanwhile, so a
        reader copies them and then keeps only what `count_still_cached` confirms."""
        size, pool = self.kv_cache.block_size, self.kv_cache.pool
        blocks: list[int] = []
        for index, block_hash in enumerate(hashes):
            block_id = pool.try_lookup(block_hash, tuple(token_ids[index * size : (index + 1) * size]))
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def count_still_cached(self, block_ids: list[int], hashes: list[int], token_ids: list[int]) -> int:
        """How many of `block_ids` (from `peek_cached_prefix`), from the first, still hold
        their blocks' contents: a block evicted since was given another hash or none."""
        size, pool = self.kv_cache.block_size, self.kv_cache.pool
        for index, block_id in enumerate(block_ids):
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            if pool.try_lookup(hashes[index], tokens) != block_id:
                return index
        return len(block_ids)

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
        return self.update.retire(request, "abort")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (as vLLM's): only while no block is in use; False
        (and nothing changed) otherwise."""
        return self.kv_cache.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def settle_kv_tier(self, wait: bool = False) -> bool:
        """Drop the references the file tier's writer no longer needs (between steps, or
        while idle); `wait`: after every queued write. True while writes are pending."""
        if self.tier is None:
            return False
        if wait:
            self.tier.flush()
        self.tier.release_written()
        return self.tier.has_pending_writes

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected
        or the process exits), and the file tier's writer; the engine cannot step afterwards."""
        if self.tier is not None:
            self.tier.close()
        if self.runner.workers is not None:
            self.runner.workers.stop()

    # --- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Two calls: the scheduler's plan runs on the runner, then `StepUpdate.apply`
        applies what it returned (step_update.py). An output for every request the step
        touched; a finished request's is its last."""
        self.expire_pins()
        if self.tier is not None:
            self.tier.release_written()
        started = time.monotonic()  # the step's time includes planning it (and proposing drafts)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return self._fail_unschedulable()
        outputs = self.update.apply(plan, self.runner.execute(plan), started)
        if self.tier is not None:
            self.tier.offer(self.kv_cache.take_full_blocks())
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        return outputs

    @property
    def last_iteration_tokens(self) -> int:
        """vLLM's tokens of an iteration: the prompts whose first token the latest step
        sampled, plus the tokens it sampled."""
        return self.update.counters.last_iteration_tokens

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
            num_generation_tokens=self.update.counters.num_generation_tokens,
            num_waiting_prompt_tokens=sum(
                r.num_expected_prefill_tokens for r in scheduler.waiting if r.status == RequestStatus.WAITING
            ),
            num_pinned_blocks=self.pins.num_blocks,
            num_pinned_requests=len(self.pins),
            num_pin_timeouts=self.pins.num_timeouts,
            prefill_tokens_per_s=self.update.counters.prefill_tokens_per_s,
            kv_tier=self.tier.snapshot() if self.tier is not None else None,
            spec_decode=self.parts.speculator.snapshot() if self.parts.speculator is not None else None,
        )


def _longest_prefix(given: RemoteKV | None, stored: RemoteKV | None, num_prompt_tokens: int) -> RemoteKV | None:
    """The KV a request starts from: a prefill replica's always; else the longer of a peer's
    and the file tier's prefix (a stored prefix never covers the last prompt token)."""
    if given is not None and (given.origin == "prefill" or stored is None or given.num_tokens >= stored.num_tokens):
        return given
    if stored is not None and stored.num_tokens < num_prompt_tokens:
        return stored
    return None
