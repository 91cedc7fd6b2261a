"""`AsyncEngine`: the engine loop in a background thread, driven from asyncio.

`generate()` is an async iterator of cumulative `RequestOutput`s. Leaving the iterator
early (a client that disconnects, a cancelled task) aborts the request, which frees its
blocks before the next step. The abort is a synchronous hand-off to the engine thread, so it
runs even when the caller's task is being cancelled and can await nothing more. The torch
work runs outside the event loop (torch releases the GIL), so an HTTP server on the loop
stays responsive while a step runs.

Only the engine thread touches the engine's state, and this class keeps the engine to
itself (`_engine`). Callers hand it their adds, aborts, resets, adapter removals, KV
connector calls (pin check-outs and releases, prefix holds and peeks), which it runs before
its next step: a lock shared with the step loop was not fair (the loop released and re-took
it at once), so a new request could wait a dozen steps behind one running decode (TTFT
0.3-1.5 s instead of 0.06 s on SmolLM2 here). What other threads do, each documented where
it happens: read what never changes after start-up (the tokenizer, the limits, the KV
layout) and the stats snapshot the engine thread replaces after each step; prepare a
request (tokenizing, bad words, compiling its grammar, reading its adapter under the LoRA
manager's lock); copy the KV of blocks the engine thread gave a reference for the copy (a
pinned prompt, a held prefix); pop the prefix-cache event queue.

A request whose own per-request work fails (see `LLMEngine.step`) raises
`RequestFailedError` to its caller only; a failure of the shared forward pass stops the
engine: every request gets `EngineDeadError` and the death callbacks run.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeAlias

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.core.block_pool import KVEvent, take_events
from pagefleet.engine.errors import EngineDeadError, RequestFailedError, ShuttingDownError
from pagefleet.engine.front.inputs import PromptType
from pagefleet.engine.front.llm_engine import LLMEngine
from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.kv_connector.peer import PeerConnector
from pagefleet.engine.kv_connector.prefill_decode import PrefillDecodeConnector
from pagefleet.engine.kv_connector.worker import KVCaches as KVCopy
from pagefleet.engine.kv_transfer.params import KVLayout, RemoteKV, StateRows
from pagefleet.engine.kv_transfer.transport import KVTransport
from pagefleet.engine.lora.request import LoRARequest
from pagefleet.engine.sample.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_Item: TypeAlias = RequestOutput | BaseException


def _put_all(items: list[tuple[asyncio.Queue[_Item], RequestOutput]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        engine: LLMEngine | None = None,
        kv_transport: KVTransport | None = None,
        **engine_args: Any,
    ) -> None:
        """Drive `engine`, or a new one of `config` (or of `engine_args`); `kv_transport`:
        how a prefill replica's answers say where decode replicas pull its KV from."""
        self._engine = engine or LLMEngine(config or EngineConfig(**engine_args), kv_transport)
        connectors = self._engine.kv_connector
        pd, peer = connectors.member(PrefillDecodeConnector), connectors.member(PeerConnector)
        assert pd is not None and peer is not None, "every engine has both"
        self._pd, self._peer = pd, peer
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[_Item]]] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._death_callbacks: list[Callable[[BaseException], None]] = []
        self._step_callbacks: list[Callable[[int], None]] = []
        # Aborts handed over by callers that cannot wait (cancelled tasks); the engine
        # thread applies them before its next step. deque.append is thread-safe.
        self._pending_aborts: collections.deque[str] = collections.deque()
        self._releases: collections.deque[Callable[[], Any]] = collections.deque()  # pin releases and check-ins
        self._calls: collections.deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        # add_request runs here: off the event loop, and as a Future an abort can wait on.
        self._adder = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagefleet-add")
        self._stats = self._engine.stats()  # written by the engine thread only; read anywhere
        self._thread = threading.Thread(target=self._run_loop, name="pagefleet-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._engine.checks.vocab_size

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for (`max_logprobs`, -1 resolved)."""
        return self._engine.max_logprobs

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        remote_kv: RemoteKV | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that changed it; the last is final.
        `remote_kv`: the prompt's KV pulled from a prefill replica (see kv_transfer).

        Raises:
            InvalidParameterError: (ValueError) before the first output, for bad input.
            RequestFailedError: this request failed inside the engine; others run on.
            ShuttingDownError: `fail_all_requests` ended it.
            EngineDeadError: the engine loop failed.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped: {self._dead}")
        request_id = request_id or f"req-{next(self._ids)}"
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            added: Future[Any] = self._adder.submit(self._add, request_id, prompt, params, remote_kv, lora_request)
        except RuntimeError as error:  # shut down
            self._queues.pop(request_id, None)
            raise EngineDeadError("the engine is shut down") from error
        try:
            await asyncio.wrap_future(added)
            self._wake.set()
            while not finished:
                item = await queue.get()
                if isinstance(item, ShuttingDownError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item}") from item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(request_id, item.error)
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                # No await here: this runs inside a cancelled task too. If the add is still
                # running, the abort follows it (a no-op if the add failed or never ran).
                added.add_done_callback(lambda _: self.abort_soon(request_id))

    def abort_soon(self, request_id: str) -> None:
        """Abort `request_id` before the engine's next step, from any thread, without
        waiting; a no-op for a request that is unknown or already finished."""
        self._pending_aborts.append(request_id)
        self._wake.set()

    def fail_all_requests(self, error: ShuttingDownError) -> None:
        """End every request now: each caller's `generate` raises `error` (a drain that ran
        out of time); their blocks are freed before the next step."""
        for loop, queue in list(self._queues.values()):
            loop.call_soon_threadsafe(queue.put_nowait, error)

    def add_step_callback(self, callback: Callable[[int], None]) -> None:
        """Call `callback(tokens the step computed)` after every step, from the engine thread,
        before the step's outputs reach their callers."""
        self._step_callbacks.append(callback)

    def add_death_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` once, from the engine thread, if the engine loop fails."""
        self._death_callbacks.append(callback)

    async def abort(self, request_id: str) -> None:
        output = await asyncio.wrap_future(self._on_engine_thread(self._engine.abort_request, request_id))
        if output is not None:
            self._deliver([output])

    def stats(self) -> EngineStats:
        """The stats after the latest step, add or abort (never waits for a step)."""
        return self._stats

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while any block is in use."""
        return bool(await asyncio.wrap_future(self._on_engine_thread(self._engine.reset_prefix_cache)))

    @property
    def serves_lora(self) -> bool:
        """Whether the engine was started with LoRA on (`enable_lora`)."""
        return self._engine.lora is not None

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Read an adapter from disk, off the engine thread (requests then name it; a slot is
        filled when one is admitted).

        Raises:
            InvalidParameterError: LoRA is off, or the adapter cannot be served.
        """
        await asyncio.to_thread(self._engine.add_lora, lora_request)

    async def remove_lora(self, name: str) -> bool:
        """Forget an adapter, between two steps (its slot may be in the step running now;
        requests running with it finish). False if it was not loaded."""
        return bool(await asyncio.wrap_future(self._on_engine_thread(self._engine.remove_lora, name)))

    def prompt_token_ids(self, prompt: PromptType, params: SamplingParams) -> list[int]:
        """The token ids the engine will compute for `prompt` (tokenized and truncated as
        `add_request` does; it reads no engine state, so any thread may ask)."""
        return self._engine.prompt_token_ids(prompt, params)

    def hash_root(self, token_ids: list[int], lora_request: LoRARequest | None, cache_salt: str | None) -> int:
        """The first link of the prompt's prefix-cache hash chain, as `add_request` sets it."""
        return self._engine.hash_root(token_ids, lora_request, cache_salt)

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE's pretraining length, past which a prompt hashes from its own root."""
        return self._engine.parts.model_config.long_rope_after

    def kv_layout(self) -> KVLayout:
        """What a KV transfer with this engine must agree on (never changes)."""
        return self._engine.kv_connector.layout

    def enable_kv_events(self) -> None:
        """Start queueing prefix-cache events (`take_kv_events`), for the fleet's index."""
        self._on_engine_thread(self._engine.kv_cache.enable_events).result()

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix-cache events queued since the last call, oldest first (never waits for a
        step: the step thread appends, this only pops)."""
        events = self._engine.kv_cache.pool.events
        return take_events(events) if events is not None else []

    def shutdown(self) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self._fail_calls(EngineDeadError("the engine is shut down"))
        self._adder.shutdown(wait=False, cancel_futures=True)
        self._engine.shutdown()

    def _add(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        remote_kv: RemoteKV | None,
        lora_request: LoRARequest | None,
    ) -> Any:
        """Tokenize the prompt and its bad words, compile its structured-output constraint
        and read its adapter here, in an adder thread (a long prompt, a large schema or a
        new adapter must not stall the steps), then add it on the engine thread."""
        prepared = self._engine.prepare_prompt(prompt, params)
        params = self._engine.with_bad_words_tokenized(params)
        self._engine.compile_grammar(params)
        self._engine.add_lora(lora_request)
        add = self._on_engine_thread(self._engine.add_request, request_id, prepared, params, remote_kv, lora_request)
        return add.result()

    async def read_pinned(
        self, request_id: str, block_ids: list[list[int]]
    ) -> tuple[list[int], KVCopy, StateRows | None]:
        """The prompt tokens, the KV of `block_ids` (per KV cache group) pinned for
        `request_id`, each layer's of its group's blocks, and for a model with state layers
        the state after them, read without stalling the steps; the blocks stay pinned until
        `release_pinned` (after a successful send) or `checkin_pinned` (a send that failed:
        another pull may come).

        Raises:
            KVTransferError: nothing pinned under that id, or other blocks.
        """
        pinned = await asyncio.wrap_future(self._on_engine_thread(self._pd.checkout, request_id, block_ids))
        try:  # pinned (and the snapshot held): nothing rewrites them
            blocks = await asyncio.to_thread(self._pd.read_blocks, block_ids)
            state = await asyncio.to_thread(self._read_state, self._pd.read_state, pinned.state_row)
        except BaseException:
            self.checkin_pinned(request_id)
            raise
        return pinned.token_ids, blocks, state

    @staticmethod
    def _read_state(read: Callable[[int], StateRows] | None, row: int | None) -> StateRows | None:
        return read(row) if read is not None and row is not None else None

    async def count_cached_prefix(self, hashes: list[int], token_ids: list[int]) -> int:
        """How many of the prompt's full blocks this replica has, in its prefix cache or its
        file tier (asked between two steps)."""
        return int(await asyncio.wrap_future(self._on_engine_thread(self._peer.count_available, hashes, token_ids)))

    async def read_cached_prefix(self, hashes: list[int], token_ids: list[int]) -> tuple[int, KVCopy, StateRows | None]:
        """Copies of the KV of the longest prefix of `hashes` this replica caches in every
        KV cache group (for a peer's pull): its block count, each layer's keys and values
        of the blocks its group needs (`needed_blocks`) and, for a model with state layers,
        the state after them. The blocks (and snapshot) are held between two steps (so no
        step evicts or rewrites them), copied beside the running steps, and released before
        the next step after the copy."""
        held = await asyncio.wrap_future(self._on_engine_thread(self._peer.hold_prefix, hashes, token_ids))
        if held.num_blocks == 0:
            return 0, [], None
        try:
            copied = await asyncio.to_thread(self._peer.read_blocks, held.block_ids)
            state = await asyncio.to_thread(self._read_state, self._peer.read_state, held.state_row)
        finally:
            self._releases.append(functools.partial(self._peer.release, held))
            self._wake.set()
        return held.num_blocks, copied, state

    def release_pinned(self, request_id: str) -> None:
        """Free a pulled prompt's blocks before the next step (from any thread, no wait)."""
        self._releases.append(functools.partial(self._pd.release, request_id))
        self._wake.set()

    def checkin_pinned(self, request_id: str) -> None:
        """A pull that failed: keep the blocks pinned for another (from any thread, no wait)."""
        self._releases.append(functools.partial(self._pd.checkin, request_id))
        self._wake.set()

    def _on_engine_thread(self, function: Callable[..., Any], *args: Any) -> Future[Any]:
        """`function(*args)`, run by the engine thread before its next step; its result or
        its exception comes in the Future."""
        future: Future[Any] = Future()
        self._calls.append((future, function, args))
        self._wake.set()
        if self._dead is not None or self._stopping.is_set():
            self._fail_calls(EngineDeadError(f"the engine stopped: {self._dead or 'shut down'}"))
        return future

    def _run_loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()  # before looking for work, so a wake-up is never lost
            self._apply_pending()
            if not self._engine.has_unfinished_requests():
                # Idle: expire pins, and free the blocks the file tier's writer is done with.
                pending = self._engine.kv_connector.between_steps()
                self._stats = self._engine.stats()
                self._wake.wait(timeout=0.01 if pending else 0.5)
                continue
            try:
                outputs = self._engine.step()
                self._stats = self._engine.stats()
            except Exception as error:  # a task boundary: fail every request, stop
                logger.exception("engine step failed; failing all requests")
                self._fail_all(error)
                return
            # The step's callbacks (the server's per-step metrics) before its outputs: a caller
            # that has its output sees the step counted, and a callback added once the
            # server's warm-up answered is never called for the warm-up's step.
            for callback in self._step_callbacks:
                callback(self._engine.last_iteration_tokens)
            self._deliver(outputs)

    def _apply_pending(self) -> None:
        """Apply what callers handed over: their calls in the order they came, then block
        releases and pin check-ins, then aborts."""
        if not self._calls and not self._pending_aborts and not self._releases:
            return
        while self._calls:
            future, function, args = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(function(*args))
                except BaseException as error:  # the caller's error, raised where it waits
                    future.set_exception(error)
        while self._releases:
            self._releases.popleft()()
        while self._pending_aborts:
            request_id = self._pending_aborts.popleft()
            if self._engine.abort_request(request_id) is not None:
                logger.info("request %s aborted: its caller left", request_id)
        self._stats = self._engine.stats()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its caller's queue: one wake-up of each event loop per step,
        however many of its requests the step touched."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], RequestOutput]]] = {}
        for output in outputs:
            target = self._queues.get(output.request_id)
            if target is not None:
                loop, queue = target
                by_loop.setdefault(loop, []).append((queue, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _fail_calls(self, error: BaseException) -> None:
        while self._calls:
            future, _, _ = self._calls.popleft()
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        self._dead = error
        self._fail_calls(EngineDeadError(f"the engine stopped: {error}"))
        for request_id in list(self._engine.requests):
            self._engine.abort_request(request_id)
        self._stats = self._engine.stats()
        for loop, queue in list(self._queues.values()):
            loop.call_soon_threadsafe(queue.put_nowait, error)
        for callback in self._death_callbacks:
            try:
                callback(error)
            except Exception:  # a task boundary: one callback must not stop the others
                logger.exception("an engine death callback failed")
