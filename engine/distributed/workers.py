"""The processes of a tensor-parallel group: rank 0 is the engine, ranks 1..N-1 are workers.

The engine spawns each worker (`spawn`, so no state is forked), and every rank joins one
torch.distributed group (gloo on CPU, nccl on CUDA) at a free local port; on the CPU the
engine also creates the shared memory the ranks all-reduce through (shm.py). A worker builds
its part of the model and its KV heads like the engine does (`engine_setup.build_device`),
then runs the steps rank 0 broadcasts, one `StepInputs` per step, until rank 0 sends None.

No orphans, no hangs: a worker whose parent is gone exits by itself; the engine checks its
workers before each step and fails with `TensorParallelError` naming a dead one, and a
worker that dies during a step breaks the step's collectives, which raise.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from pagefleet.engine.config import EngineConfig
from pagefleet.engine.distributed.shm import SharedMemoryAllReduce
from pagefleet.engine.errors import EngineDeadError

logger = logging.getLogger(__name__)

# How long a collective may wait for the other ranks; a dead rank usually breaks the
# connection at once, and this bounds the other cases.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


class TensorParallelError(EngineDeadError):
    """A tensor-parallel worker died or could not start: the engine cannot step."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def init_group(rank: int, size: int, port: int, device: torch.device) -> None:
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )


class Workers:
    """Rank 0's handle on ranks 1..N-1: start them, send each step, stop them."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        size = config.tensor_parallel_size
        self.port = free_port()
        self.shared_memory = None
        if config.torch_device.type == "cpu":
            directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = os.path.join(directory, f"pagefleet-tp-{os.getpid()}-{self.port}")
            self.shared_memory = SharedMemoryAllReduce(path, 0, size, create=True)
        memory_path = self.shared_memory.path if self.shared_memory is not None else None
        context = multiprocessing.get_context("spawn")
        self.processes: list[BaseProcess] = [
            context.Process(
                target=run_worker,
                args=(config, model_dir, rank, size, self.port, os.getpid(), memory_path),
                name=f"pagefleet-tp-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        self.stepping = False  # set once every rank has built its part: the workers wait for steps
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.shared_memory)
        try:
            for process in self.processes:
                process.start()
        except BaseException:
            self._finalizer()
            raise
        logger.info("tensor parallelism: started %d worker(s), rendezvous on port %d", len(self.processes), self.port)

    def check(self) -> None:
        """Raises TensorParallelError if a worker has exited."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}; "
                    "the engine cannot run steps without it"
                )

    def send(self, step: Any) -> None:
        """Broadcast one step's inputs (None: stop) to every worker."""
        self.check()
        try:
            dist.broadcast_object_list([step], src=0)
        except Exception as error:  # a worker died: its connection broke
            deadline = time.monotonic() + 2  # time for the dead one to be reaped, so check names it
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
            self.check()
            raise TensorParallelError(f"tensor-parallel broadcast failed: {error}") from error

    def stop(self) -> None:
        """Tell the workers to exit, then make sure they did."""
        if self._finalizer.alive:
            try:
                if self.stepping and all(process.exitcode is None for process in self.processes):
                    dist.broadcast_object_list([None], src=0)
            except Exception:  # a broken group: the workers are stopped by force below
                logger.warning("could not tell the tensor-parallel workers to stop", exc_info=True)
            self._finalizer()


def _stop(processes: list[BaseProcess], shared_memory: SharedMemoryAllReduce | None) -> None:
    """Wait briefly for workers told to stop; kill the rest (an engine collected or a
    process exiting never told them); leave the process group."""
    deadline = time.monotonic() + 2
    for process in processes:
        if process.pid is None:  # never started
            continue
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join(5)
    if shared_memory is not None:
        shared_memory.close(remove=True)
    try:  # this process leaves the group, so another tensor-parallel engine can start in it
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the interpreter may be exiting: nothing more to free
        logger.debug("could not leave the tensor-parallel process group", exc_info=True)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker outlives no engine: when its parent is gone, it exits at once."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def run_worker(
    config: EngineConfig, model_dir: str, rank: int, size: int, port: int, parent_pid: int, memory_path: str | None
) -> None:
    """A worker process: its part of the model, then the steps rank 0 sends."""
    from pathlib import Path

    from pagefleet.engine.distributed.shard import Shard
    from pagefleet.engine.front.engine_setup import build_device

    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    logging.basicConfig(level=os.environ.get("PAGEFLEET_LOG_LEVEL", "WARNING"))
    init_group(rank, size, port, config.torch_device)
    shared_memory = SharedMemoryAllReduce(memory_path, rank, size) if memory_path is not None else None
    device = build_device(config, Path(model_dir), Shard(rank, size, shared_memory=shared_memory))
    runner = device.runner
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            break
        runner.forward(message[0])
    dist.destroy_process_group()
    if shared_memory is not None:
        shared_memory.close()
