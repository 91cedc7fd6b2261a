"""`CoreProcess`: an `OfflineCore` in a process of its own, for an `LLM` whose caller's
process cannot run the engine at its speed.

libgomp reads its spin-waiting once, when torch loads it (omp_settings): a caller that
imported torch before `pagefleet.engine`, under OMP_WAIT_POLICY=PASSIVE, would run every
step 9-10% slower. vLLM runs its engine core in a process of its own for the same reasons;
so does `LLM` then. The child is `python -m pagefleet.engine.front.core_process FD`, which
imports `pagefleet.engine` before torch; it talks over a socket pair (pickled calls, one at
a time, replies in order), so no `if __name__ == "__main__"` guard is needed in the
caller's script. It leaves when its socket closes (the caller exited or was killed), and
Ctrl-C in the caller reaches it as an interruption of the call running, which frees every
block it held, as in this process.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.errors import EngineDeadError
from pagefleet.engine.front.offline_core import OfflineCore, OfflineRequest
from pagefleet.engine.front.outputs import RequestOutput
from pagefleet.engine.front.stats import EngineStats
from pagefleet.engine.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 30.0


class CoreProcess:
    """The methods of `OfflineCore`, run by a child process."""

    def __init__(self, config: EngineConfig) -> None:
        """Start the child and wait until its engine is built; its errors (an unsupported
        model, a bad setting) are raised here as they would be in this process."""
        ours, theirs = socket.socketpair()
        with theirs:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C reaches it through `_call` only
            )
        self._connection = Connection(ours.detach())
        self._stopped = False
        try:
            self._connection.send(config)
            self.tokenizer: Any = self._receive()
        except BaseException:
            self.shutdown()
            raise
        logger.info("engine core process %d started", self._process.pid)

    def run(self, requests: list[OfflineRequest], show_progress: bool) -> list[RequestOutput]:
        return self._call("run", requests, show_progress)  # type: ignore[no-any-return]

    def list_loras(self) -> list[str]:
        return self._call("list_loras")  # type: ignore[no-any-return]

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return bool(self._call("add_lora", lora_request))

    def remove_lora(self, lora: str | int) -> bool:
        return bool(self._call("remove_lora", lora))

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("reset_prefix_cache"))

    def stats(self) -> EngineStats:
        return self._call("stats")  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        """Stop the child's engine (its tensor-parallel workers too) and wait for it to exit."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._connection.send(("shutdown", ()))
            self._connection.close()
            self._process.wait(timeout=_STOP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()

    def _call(self, name: str, *args: Any) -> Any:
        if self._stopped:
            raise EngineDeadError("the engine is shut down")
        self._connection.send((name, args))
        try:
            return self._receive()
        except KeyboardInterrupt:
            self._process.send_signal(signal.SIGINT)  # the call ends, its requests aborted
            try:
                self._receive()
            except KeyboardInterrupt:
                pass
            raise

    def _receive(self) -> Any:
        try:
            kind, value = self._connection.recv()
        except (EOFError, OSError) as error:
            code = self._process.poll()
            raise EngineDeadError(f"the engine process exited (code {code})") from error
        if kind == "error":
            raise value
        return value


def _crossing(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError with its message if it cannot be rebuilt on the other side."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Interruptions:
    """SIGINT interrupts a call that runs; between calls it is ignored (the caller sends it
    only while it waits for a reply, which may already be on its way)."""

    def __init__(self) -> None:
        self.in_call = False
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, *_: object) -> None:
        if self.in_call:
            raise KeyboardInterrupt


def _serve(connection: Connection) -> None:
    from pagefleet.engine.front.llm_engine import LLMEngine

    interruptions = _Interruptions()
    config: EngineConfig = connection.recv()
    try:
        core = OfflineCore(LLMEngine(config))
    except BaseException as error:
        connection.send(("error", _crossing(error)))
        return
    connection.send(("ok", core.tokenizer))
    while True:
        try:
            name, args = connection.recv()
        except EOFError:  # the caller left
            break
        if name == "shutdown":
            break
        try:
            interruptions.in_call = True
            reply = ("ok", getattr(core, name)(*args))
        except BaseException as error:  # the caller's error, raised where it waits
            reply = ("error", _crossing(error))
        finally:
            interruptions.in_call = False
        connection.send(reply)
    core.shutdown()


if __name__ == "__main__":  # `pagefleet.engine`, a parent package, applied its OpenMP settings first
    _serve(Connection(int(sys.argv[1])))
    sys.stdout.flush()
    os._exit(0)  # tensor-parallel workers and connector threads are stopped; skip the rest
