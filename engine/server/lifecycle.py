"""Start-up and shutdown of one replica, as the app's lifespan.

Start-up loads the model in a thread (so `/health` answers 503 until it is loaded and
warm), then starts publishing KV capacity (and the prefix cache's events) to Redis if a URL
is set. Shutdown removes the Redis record and stops the engine.

On SIGTERM (`drain`, called by `pagefleet serve`'s runner) the replica drains: it withdraws
its Redis record at once (routers stop sending it work within one refresh), reports
not-ready on `/ready` while `/health` stays live, answers new requests with a 503 that the
gateway retries elsewhere, lets the requests in flight finish (streams included) for up to
`--shutdown-timeout` seconds, ends any still running with an error in its API's shape (an
error event in a stream), then stops the server: the process exits 0.

If the engine dies (its shared forward pass failed), the replica withdraws its Redis record
at once, `/health` fails, and after a short grace for in-flight error responses the server
stops and the process exits with `EXIT_ENGINE_DEAD`, so that its supervisor (Kubernetes,
`pagefleet up`) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from opentelemetry.sdk.trace import TracerProvider

from pagefleet.engine.errors import ShuttingDownError
from pagefleet.engine.front.async_engine import AsyncEngine
from pagefleet.engine.front.inputs import PromptType
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.sample.sampling_params import SamplingParams
from pagefleet.engine.server.lora import parse_lora_modules
from pagefleet.engine.server.publisher import CapacityPublisher
from pagefleet.engine.server.settings import ServerSettings
from pagefleet.engine.server.state import ServerState

logger = logging.getLogger(__name__)

EXIT_ENGINE_DEAD = 3  # the process's exit code after its engine died
EXIT_LOAD_FAILED = 4  # ... after its model failed to load
LEAVE_FLEET_TIMEOUT_S = 5.0  # the most a drain waits for Redis to drop its record (it expires anyway)


class ReplicaLifecycle:
    """Args:
    state: the server's state; this class writes its `engine`, `load_error` and `exit_code`.
    engine: one built already (tests), else one is built from the settings.
    stop_server: makes the HTTP server stop gracefully (when the engine dies or fails to load).
    tracer_provider: flushed at shutdown.
    """

    def __init__(
        self,
        state: ServerState,
        engine: AsyncEngine | None,
        stop_server: Callable[[], None] | None,
        tracer_provider: TracerProvider | None,
    ) -> None:
        self.state, self.prebuilt, self.stop_server = state, engine, stop_server
        self.tracer_provider = tracer_provider
        self._publisher: CapacityPublisher | None = None
        self._publishing: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @contextlib.asynccontextmanager
    async def lifespan(self, _: object) -> AsyncIterator[None]:
        self._loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._start()))
        yield
        await self._stop()

    def drain_soon(self) -> bool:
        """Start draining (see the module docstring), from any thread or a signal handler;
        False if the server is not running yet or drains already."""
        if self._loop is None or self.state.draining:
            return False
        self.state.draining = True  # before the hand-off: no request is admitted from now on
        self._loop.call_soon_threadsafe(lambda: self._tasks.append(asyncio.create_task(self._drain())))
        return True

    async def _drain(self) -> None:
        state, loop = self.state, asyncio.get_running_loop()
        timeout = state.settings.shutdown_timeout
        logger.info("draining: %d requests in flight get up to %.0f s to finish", state.num_in_flight, timeout)
        try:
            # Bounded: a Redis command cut off by the publisher's cancellation (a drain that
            # starts while the first report is on the wire) once left this waiting for good.
            await asyncio.wait_for(self._leave_fleet(), LEAVE_FLEET_TIMEOUT_S)
        except TimeoutError:
            logger.warning("draining: Redis did not confirm the removal in %.0f s; it expires", LEAVE_FLEET_TIMEOUT_S)
        deadline = loop.time() + timeout
        while state.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if state.num_in_flight and state.engine is not None:
            logger.warning("draining: %d requests did not finish in time; ending them", state.num_in_flight)
            state.engine.fail_all_requests(
                ShuttingDownError(f"The server is shutting down and the request did not finish within {timeout:g} s.")
            )
            deadline = loop.time() + 5  # their error answers go out
            while state.num_in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
        logger.info("drained; stopping")
        if self.stop_server is not None:
            self.stop_server()

    async def _leave_fleet(self) -> None:
        """Remove the Redis record, after the last report (none may follow the removal)."""
        if self._publisher is not None and self._publishing is not None:
            self._publishing.cancel()
            await asyncio.gather(self._publishing, return_exceptions=True)
            await self._publisher.remove()

    async def _start(self) -> None:
        state = self.state
        await _load(state, self.prebuilt)
        if state.engine is None:
            if self.stop_server is not None:  # nothing to serve: exit, so a supervisor sees it at once
                state.exit_code = EXIT_LOAD_FAILED
                self.stop_server()
            return
        state.metrics.engine_loaded(state.engine.max_model_len, _cache_config(state.settings, state.engine.stats()))
        assert state.metrics.vllm is not None, "engine_loaded makes vLLM's metrics"
        state.engine.add_step_callback(state.metrics.vllm.iteration_tokens.observe)
        loop, died = asyncio.get_running_loop(), asyncio.Event()
        state.engine.add_death_callback(lambda _: loop.call_soon_threadsafe(died.set))
        self._tasks.append(asyncio.create_task(self._withdraw_when_dead(died)))
        settings = state.settings
        if settings.redis_url:
            state.engine.enable_kv_events()  # the fleet's prefix index (kv_events.py)
            self._publisher = CapacityPublisher(
                settings.redis_url,
                settings.model_name,
                settings.replica,
                settings.url,
                state.engine.max_model_len,
                state.engine.stats,
                settings.publish_interval,
                settings.record_ttl,
                settings.restarts,
                settings.role,
                state.adapters.paths,
                state.engine.take_kv_events,
            )
            self._publishing = asyncio.create_task(self._publisher.run())
            self._tasks.append(self._publishing)

    async def _withdraw_when_dead(self, died: asyncio.Event) -> None:
        await died.wait()
        self.state.exit_code = EXIT_ENGINE_DEAD
        logger.critical("the engine stopped; leaving the fleet and exiting with code %d", EXIT_ENGINE_DEAD)
        await self._leave_fleet()
        await asyncio.sleep(self.state.settings.exit_grace)  # in-flight requests get their error answers
        if self.stop_server is not None:
            self.stop_server()

    async def _stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._publisher is not None:
            await self._publisher.remove()
        state = self.state
        await state.transfers.close()
        await state.responses.close()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        if self.tracer_provider is not None:
            await asyncio.to_thread(self.tracer_provider.shutdown)  # the last spans go out


def _cache_config(settings: ServerSettings, stats: EngineStats) -> dict[str, str]:
    """The KV cache's settings as vLLM's cache_config_info labels them."""
    return {
        "block_size": str(stats.block_size),
        "cache_dtype": "auto",  # the KV cache holds the model's dtype
        "enable_prefix_caching": str(settings.enable_prefix_caching),
        "num_gpu_blocks": str(stats.num_total_blocks),  # the device's blocks, a CPU's included
        "swap_space": str(settings.swap_space),
    }


async def _load(state: ServerState, engine: AsyncEngine | None) -> None:
    """Load the model (in a thread) and the adapters of --lora-modules, warm it up with one
    token, then mark ready."""
    try:
        config, transport = state.settings.engine_config(), state.transfers.transport
        loaded: AsyncEngine = engine or await asyncio.to_thread(AsyncEngine, config, kv_transport=transport)
        for name, path in parse_lora_modules(state.settings.lora_modules):
            await state.adapters.load(loaded, name, path)
        warm_up: PromptType = "Hello" if loaded.tokenizer is not None else {"prompt_token_ids": [0]}
        async for _ in loaded.generate(warm_up, SamplingParams(max_tokens=1, temperature=0.0)):
            pass
        state.warm_up_stats = loaded.stats()
        state.engine = loaded
        logger.info("serving %s (max_model_len %d)", state.settings.model_name, loaded.max_model_len)
    except Exception as error:
        state.load_error = error
        logger.exception("the model failed to load")
