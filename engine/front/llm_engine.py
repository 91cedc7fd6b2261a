"""The synchronous engine core: add requests, `step()` them forward, read outputs.

One step is two calls: the scheduler's plan (chunks in batch order, samples, forks, block
copies) runs on the runner (block copies, forward pass, sampling), then `StepUpdate`
applies the results (progress, forks, prefix-cache registration, detokenization, stop
checks, what the KV connectors keep, freeing). KV from outside the forward pass (a prefill
replica's, the file tier's, a peer's) comes and goes through the KV connectors
(engine/kv_connector), which the scheduler and the step's update call. `LLM` drives the
engine in a loop; `AsyncEngine` drives it from a background thread. What a request is
checked and prepared with before it enters lives in request_checks.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.core.request import Request, RequestStatus
from pagefleet.engine.core.runner_input import runner_input
from pagefleet.engine.core.scheduler import Scheduler
from pagefleet.engine.errors import InvalidParameterError
from pagefleet.engine.front.detokenizer import Detokenizer
from pagefleet.engine.front.engine_setup import build_engine_parts
from pagefleet.engine.front.inputs import PreparedPrompt, PromptType, prefix_hash_root
from pagefleet.engine.front.output_processor import OutputProcessor
from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.front.request_checks import RequestChecks
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.front.step_update import StepCounters, StepUpdate
from pagefleet.engine.kv_connector.base import ConnectorStats
from pagefleet.engine.kv_connector.setup import build_connectors
from pagefleet.engine.kv_transfer.params import KVLayout, RemoteKV
from pagefleet.engine.kv_transfer.transport import KVTransport
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.sample.beam_search import BeamSearchState
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.sim.runner import refuse_unmodelled

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, frozen=True)
class _CheckedRequest:
    """A request as `LLMEngine._checked` accepted it."""

    prepared: PreparedPrompt
    params: SamplingParams
    remote_kv: RemoteKV | None  # a prefill replica's or a peer's, pulled by the caller
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

    def __init__(self, config: EngineConfig, kv_transport: KVTransport | None = None) -> None:
        """`kv_transport`: how a prefill replica's answers say where decode replicas pull
        its KV from (the server's)."""
        self.config = config
        self.parts = build_engine_parts(config)
        self.tokenizer = self.parts.tokenizer
        self.max_model_len = self.parts.max_model_len
        model_config = self.parts.model_config
        self.max_logprobs = model_config.vocab_size if config.max_logprobs == -1 else config.max_logprobs
        self.kv_cache = self.parts.kv_cache
        if self.kv_cache.states is not None:  # never more sequences than state slots (state_setup.py)
            config = self.config = dataclasses.replace(config, max_num_seqs=self.kv_cache.states.device.num_slots)
        self.runner = self.parts.runner
        self.lora = self.parts.lora
        counters = StepCounters()
        self.kv_connector = build_connectors(
            config,
            self._kv_layout(),
            self.kv_cache,
            self.runner.cache_layer_caches,
            getattr(self.runner, "state_cache", None),
            lambda: counters.prefill_tokens_per_s,
            kv_transport,
        )
        self.scheduler = Scheduler(
            config,
            self.kv_cache,
            self.lora,
            self.parts.speculator,
            self.kv_connector,
            long_rope_after=self.parts.model_config.long_rope_after,
        )
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
            self.kv_cache.groups,
            config.max_num_batched_tokens,
            has_state=self.kv_cache.states is not None,
        )
        self._arrivals = itertools.count()
        self._num_prompt_tokens = 0
        self.update = StepUpdate(
            self.kv_cache, self.scheduler, self.outputs, self.kv_connector, counters, self.parts.speculator
        )

    def _kv_layout(self) -> KVLayout:
        """What a KV transfer with this replica must agree on (its cache layers' KV)."""
        model = self.parts.model_config
        groups = self.kv_cache.groups
        return KVLayout(
            model=self.config.model,
            num_layers=len(model.cache_layers),
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            block_size=self.kv_cache.block_size,
            dtype=str(self.config.torch_dtype).removeprefix("torch."),
            group_windows=groups.windows,
            layer_groups=groups.layer_groups,
            layer_shapes=tuple(model.layer_kv_shape(layer) for layer in model.cache_layers),
            num_state_layers=len(model.state_layers),
            state_shapes=model.linear_attention.state_shapes() if model.linear_attention is not None else (),
        )

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
        request), or its prefix's from a peer (ignored with prompt logprobs: the prompt is
        computed here). `params.extra_args["kv_transfer_params"]` with `do_remote_decode`
        makes it a prefill replica's request, whose prompt blocks stay pinned for a pull.
        `lora_request`: the adapter to run with (the engine needs enable_lora=True).

        Raises:
            InvalidParameterError: (ValueError) naming the field, e.g. an empty prompt or a
                prompt longer than max_model_len.
        """
        checked = self._checked(request_id, prompt, params, remote_kv, lora_request)
        request = self._new_request(request_id, checked, lora_request)
        self.kv_connector.request_added(request, checked.remote_kv if request.prompt_logprobs is None else None)
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
        prepared = prompt if isinstance(prompt, PreparedPrompt) else self.prepare_prompt(prompt, params)
        token_ids = prepared.token_ids
        checks.validate_prompt(token_ids)
        if remote_kv is None or remote_kv.origin == "prefill":
            checks.check_kv_role(params, remote_kv, token_ids)
        self.add_lora(lora_request)
        params = checks.with_logprobs_resolved(checks.with_bad_words_tokenized(params))
        if self.config.simulate is not None:
            refuse_unmodelled(params)
        checks.check_token_constraints(params)
        grammar = checks.compile_grammar(params)
        max_tokens = checks.resolve_max_tokens(len(token_ids), params)
        return _CheckedRequest(prepared, params, remote_kv, grammar, max_tokens)

    def hash_root(self, token_ids: list[int], lora_request: LoRARequest | None, cache_salt: str | None) -> int:
        """The first link of the prompt's prefix-cache hash chain (it reads no engine state,
        so any thread may ask)."""
        return prefix_hash_root(lora_request, cache_salt, self._rotates_long(token_ids))

    def _rotates_long(self, token_ids: list[int]) -> bool:
        """Whether a prompt is longer than the model's LongRoPE pretraining length."""
        long_after = self.parts.model_config.long_rope_after
        return long_after is not None and len(token_ids) > long_after

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
        request.rotates_long = self._rotates_long(token_ids)
        root = prefix_hash_root(lora_request, cache_salt, request.rotates_long)
        for seq in request.sequences:
            seq.hash_root = root
        if self.parts.model_config.long_rope_after is not None and not request.rotates_long:
            request.long_rope_root = prefix_hash_root(lora_request, cache_salt, long_rope=True)
        if params.use_beam_search:
            request.beam = BeamSearchState(params, max_tokens, self._stop_token_ids(params))
        if checked.grammar is not None:
            for seq in request.sequences:
                seq.grammar = self.checks.matcher(checked.grammar)
        if remote_kv is None or remote_kv.origin != "prefill":
            hit = self.kv_cache.find_prefix_hits(request.sequences[0], len(token_ids))
            known = max(hit.num_blocks * self.kv_cache.block_size, remote_kv.num_tokens if remote_kv is not None else 0)
            request.num_expected_prefill_tokens = len(token_ids) - known
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

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done when the engine is collected
        or the process exits), and the connectors' threads; the engine cannot step afterwards."""
        self.kv_connector.close()
        if self.runner.workers is not None:
            self.runner.workers.stop()

    # --- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Two calls: the scheduler's plan runs on the runner, then `StepUpdate.apply`
        applies what it returned (step_update.py). An output for every request the step
        touched; a finished request's is its last."""
        self.kv_connector.between_steps()
        started = time.monotonic()  # the step's time includes planning it (and proposing drafts)
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return self._fail_unschedulable()
        results = self.runner.execute(runner_input(plan, self.runner.model_config.vocab_size))
        snapshots = self.kv_cache.state_copies_ran(plan.copies)
        outputs = self.update.apply(plan, results, started)
        if self.kv_connector.wants_filled_blocks:
            self.kv_connector.blocks_filled(self.kv_cache.take_full_blocks())
            self.kv_connector.snapshots_kept(snapshots)
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
        if self.kv_connector.is_loading(request):
            self.kv_connector.wait_for_load(request, timeout=0.05)  # nothing else to run meanwhile
            return []
        logger.error("request %s cannot fit the KV cache even alone; failing it", request.request_id)
        output = self.abort_request(request.request_id)
        return [output] if output is not None else []

    # --- stats --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        usage, cache_stats, scheduler = self.kv_cache.usage(), self.kv_cache.stats, self.scheduler
        connected = ConnectorStats()
        self.kv_connector.fill_stats(connected)
        return EngineStats(
            num_total_blocks=usage.num_blocks,
            num_free_blocks=usage.num_free_blocks,
            num_free_tokens=self.kv_cache.admissible_tokens(usage.num_free_blocks * self.kv_cache.block_size),
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
            num_pinned_blocks=connected.num_pinned_blocks,
            num_pinned_requests=connected.num_pinned_requests,
            num_pin_timeouts=connected.num_pin_timeouts,
            prefill_tokens_per_s=self.update.counters.prefill_tokens_per_s,
            **self.kv_cache.state_usage(),
            kv_tier=connected.kv_tier,
            spec_decode=self.parts.speculator.snapshot() if self.parts.speculator is not None else None,
        )
