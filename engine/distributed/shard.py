"""Which part of a model one tensor-parallel rank holds, and the collectives it joins.

Megatron-style: q/k/v and gate/up are split by output rows (column-parallel), the output
and down projections by input columns (row-parallel, one all-reduce each), the embedding
and LM head by vocabulary rows. With fewer KV heads than ranks, each rank keeps the one KV
head its query heads read (replicated, as vLLM does). A mixture of experts' routed experts
are split whole (expert parallelism): each rank holds an equal share of them and all-reduces
its partial sum. A `Shard` of size 1 is the whole model and its collectives do nothing, so
the model code has one path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pagefleet.engine.distributed.shm import SharedMemoryAllReduce
from pagefleet.engine.errors import UnsupportedModelError

Transform = Callable[[torch.Tensor], torch.Tensor]  # as the weight loader's


@dataclass(slots=True)
class Shard:
    rank: int = 0
    size: int = 1
    reduce_seconds: float = field(default=0.0, compare=False)  # time in all-reduces and gathers
    # On the CPU, all-reduces through shared memory (shm.py) instead of gloo's loopback TCP.
    shared_memory: SharedMemoryAllReduce | None = field(default=None, compare=False)

    def split(self, total: int, what: str) -> tuple[int, int]:
        """[start, end) of this rank's equal part of `total` (which must divide evenly)."""
        if total % self.size:
            raise UnsupportedModelError(f"{what} ({total}) is not divisible by tensor_parallel_size={self.size}")
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, how many) of this rank: its share, or the one head its query
        heads read when there are fewer KV heads than ranks."""
        self.split(num_heads, "num_attention_heads")
        if num_kv_heads >= self.size:
            start, end = self.split(num_kv_heads, "num_key_value_heads")
            return start, end - start
        if self.size % num_kv_heads:
            raise UnsupportedModelError(
                f"tensor_parallel_size={self.size} is not a multiple of num_key_value_heads ({num_kv_heads})"
            )
        return self.rank * num_kv_heads // self.size, 1

    def experts(self, num_experts: int) -> range:
        """This rank's routed experts (expert parallelism): an equal share, in id order.

        Raises:
            UnsupportedModelError: num_experts does not divide evenly between the ranks.
        """
        return range(*self.split(num_experts, "num_experts"))

    def stacked_experts(self, num_experts: int) -> Transform | None:
        """A weight transform: this rank's experts of a checkpoint tensor stacking every
        expert's along dim 0 (`[E, ...]`); None with one rank (the whole tensor)."""
        mine = self.experts(num_experts)
        return rows(mine.start, mine.stop) if self.size > 1 else None

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary rows, every rank's part padded to one size."""
        part = -(-vocab_size // self.size)
        return self.rank * part, (self.rank + 1) * part

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Embeddings of `ids` from this rank's vocabulary rows, summed over the ranks."""
        if self.size == 1:
            return F.embedding(ids, weight)
        start = self.rank * weight.shape[0]
        local = ids - start
        outside = (local < 0) | (local >= weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), weight)
        return self.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            started = time.perf_counter()
            if self.shared_memory is not None and self.shared_memory.fits(x):
                self.shared_memory(x)
            else:
                dist.all_reduce(x)
            self.reduce_seconds += time.perf_counter() - started
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's logits of its vocabulary part -> the whole rows on rank 0 (None on
        the others): only the rank that samples needs them."""
        if self.size == 1:
            return logits
        started = time.perf_counter()
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits, parts, dst=0)
        self.reduce_seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else None


def rows(start: int, end: int) -> Transform:
    """A weight transform: rows [start, end) of a checkpoint tensor."""
    return lambda tensor: tensor[start:end].clone()  # a copy: the whole tensor is freed


def chain(first: Transform | None, then: Transform | None) -> Transform | None:
    """A weight transform: `first`, then `then` (either may be None: no transform)."""
    if first is None or then is None:
        return first or then
    return lambda tensor: then(first(tensor))


def columns(start: int, end: int) -> Transform:
    """A weight transform: columns [start, end) of a checkpoint tensor."""
    return lambda tensor: tensor[:, start:end].contiguous()


def vocab_rows(start: int, end: int) -> Transform:
    """Rows [start, end) of an embedding, zero rows past the vocabulary's end."""

    def take(tensor: torch.Tensor) -> torch.Tensor:
        part = tensor[start:end].clone()
        if part.shape[0] < end - start:
            part = torch.cat([part, part.new_zeros(end - start - part.shape[0], *part.shape[1:])])
        return part

    return take
