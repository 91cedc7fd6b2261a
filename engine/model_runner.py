"""Turns a schedule plan into one forward pass over a flat token batch and samples.

Owns the device KV cache (per layer, K and V shaped [num_blocks, block_size, num_kv_heads,
head_dim]) and the host pool used for swapping.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from pagefleet.engine.kv_cache_manager import PendingCopies
from pagefleet.engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillSpan,
    StepLayout,
    allocate_kv_cache,
)
from pagefleet.engine.lora.manager import LoRAManager
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.loading import CausalLM
from pagefleet.engine.request import Sequence
from pagefleet.engine.sampler import Sampler, SampleResult, TokenLogprobs, token_logprobs
from pagefleet.engine.sampling_params import SamplingParams
from pagefleet.engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SampleRequest:
    chunk_index: int  # sample from the logits after this chunk's last token
    seq: Sequence  # who samples: the chunk's own sequence, or a sibling forking from it
    params: SamplingParams


@dataclass(slots=True)
class PromptLogprobs:
    chunk_index: int
    start_position: int  # the chunk's first position; position p scores prompt token p + 1
    values: TokenLogprobs  # one row per position of the chunk that has a next prompt token


@dataclass(slots=True)
class RequestResults:
    """One request's part of a step: its sampled rows and prompt logprobs, or the error
    that its own part raised (the forward pass is shared; sampling is per request)."""

    samples: list[SampleRequest] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # rows[i]: the row of samples[i] in `sampled`
    sampled: SampleResult | None = None
    prompt_logprobs: PromptLogprobs | None = None
    error: Exception | None = None


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        backend: AttentionBackend,
        num_blocks: int,
        num_host_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model, self.model_config, self.backend = model, model_config, backend
        self.lora = lora
        self.block_size, self.device = block_size, device
        shape = (block_size, model_config.num_kv_heads, model_config.head_dim)

        def cache_pair(blocks: int, where: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
            return allocate_kv_cache(blocks, *shape, dtype, where), allocate_kv_cache(blocks, *shape, dtype, where)

        self.kv_caches = [cache_pair(num_blocks, device) for _ in range(model_config.num_layers)]
        self.host_caches = [
            cache_pair(num_host_blocks, "cpu") for _ in range(model_config.num_layers if num_host_blocks else 0)
        ]
        self.sampler = Sampler(model_config.eos_token_ids, seed)

    def run_copies(self, copies: PendingCopies) -> None:
        """Swap-outs first (their device blocks may be reused below), then swap-ins, then
        KV pulled from prefill replicas, then copy-on-write copies."""
        for pairs, source, target in (
            (copies.swap_out, self.kv_caches, self.host_caches),
            (copies.swap_in, self.host_caches, self.kv_caches),
        ):
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs])
            dst = torch.tensor([p[1] for p in pairs])
            for (src_k, src_v), (dst_k, dst_v) in zip(source, target, strict=True):
                dst_k[dst.to(dst_k.device)] = src_k[src.to(src_k.device)].to(dst_k.device)
                dst_v[dst.to(dst_v.device)] = src_v[src.to(src_v.device)].to(dst_v.device)
        for block_ids, remote in copies.loads:
            index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            for (key_cache, value_cache), keys, values in zip(self.kv_caches, remote.keys, remote.values, strict=True):
                key_cache[index] = keys.to(key_cache.device, key_cache.dtype)
                value_cache[index] = values.to(value_cache.device, value_cache.dtype)
        if copies.device:
            mapping = torch.tensor(copies.device, dtype=torch.int64, device=self.device)
            for key_cache, value_cache in self.kv_caches:
                self.backend.copy_blocks(key_cache, value_cache, mapping)

    @torch.inference_mode()
    def execute(
        self,
        chunks: list[ScheduledChunk],
        samples: list[SampleRequest],
        prompt_logprob_chunks: list[int],
    ) -> dict[str, RequestResults]:
        """Run the forward pass for `chunks` (decodes must come first), then sample.

        Returns each request's results by request id. A failure of the forward pass raises
        (every request shares it); a failure in one request's sampling or prompt logprobs
        is that request's `error`.
        """
        input_ids, positions, metadata, last_rows = self._build_batch(chunks)
        if self.lora is not None:
            self.lora.set_batch([slot for c in chunks for slot in [c.request.lora_slot_index] * c.num_new_tokens])
        hidden = self.model(input_ids, positions, self.kv_caches, metadata, self.backend)
        results: dict[str, RequestResults] = {}

        def results_of(chunk_index: int) -> RequestResults:
            return results.setdefault(chunks[chunk_index].request.request_id, RequestResults())

        if samples:
            rows = torch.tensor([last_rows[s.chunk_index] for s in samples], device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows)).cpu()
            self._sample(logits, samples, [results_of(s.chunk_index) for s in samples])
        for index in prompt_logprob_chunks:
            owner = results_of(index)
            try:
                owner.prompt_logprobs = self._prompt_logprobs(hidden, chunks, index, last_rows[index])
            except Exception as error:  # this request's own work: it fails alone
                owner.error = error
        return results

    def _sample(self, logits: torch.Tensor, samples: list[SampleRequest], owners: list[RequestResults]) -> None:
        """Sample every row in one batch. If the batch fails, sample each request alone,
        so that only the request at fault fails and the others keep their tokens."""
        seqs, params = [s.seq for s in samples], [s.params for s in samples]
        try:
            result = self.sampler(logits, seqs, params)
        except Exception:
            logger.warning("batched sampling failed; sampling each request alone", exc_info=True)
            groups: dict[int, list[int]] = {}
            for index, owner in enumerate(owners):
                groups.setdefault(id(owner), []).append(index)
            for indices in groups.values():
                owner = owners[indices[0]]
                try:
                    alone = self.sampler(logits[indices], [seqs[i] for i in indices], [params[i] for i in indices])
                except Exception as error:  # this request's own parameters: it fails alone
                    owner.error = error
                    continue
                owner.samples, owner.rows, owner.sampled = (
                    [samples[i] for i in indices],
                    list(range(len(indices))),
                    alone,
                )
            return
        for row, (sample, owner) in enumerate(zip(samples, owners, strict=True)):
            owner.samples.append(sample)
            owner.rows.append(row)
            owner.sampled = result

    def _build_batch(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The flat batch of `chunks` and the backend's metadata for it (built once, here)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        decode_context, decode_tables = [], []
        prefills: list[PrefillSpan] = []
        for chunk in chunks:
            start, end, num_new = chunk.start, chunk.end, chunk.num_new_tokens
            row = len(input_ids)
            input_ids.extend(chunk.seq.token_ids[start:end])
            table = chunk.block_table[: (end + bs - 1) // bs]
            if num_new == 1:
                assert not prefills, "decode chunks must come before prefill chunks"
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                decode_context.append(end)
                decode_tables.append(table)
            else:
                pos = np.arange(end)
                context_slots = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
                positions.extend(range(start, end))
                slots.extend(context_slots[start:end].tolist())
                prefills.append(PrefillSpan(row, num_new, end, table, context_slots))
            last_rows.append(row + num_new - 1)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        metadata = self.backend.prepare(StepLayout(slot_mapping, decode_context, decode_tables, prefills))
        return (
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            metadata,
            last_rows,
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, chunks: list[ScheduledChunk], index: int, last_row: int
    ) -> PromptLogprobs:
        """Logprobs of the prompt tokens that follow each position of chunk `index`."""
        chunk = chunks[index]
        seq, request = chunk.seq, chunk.request
        start = chunk.start
        # Position p predicts token p + 1; the prompt's last position predicts no prompt token.
        end = min(start + chunk.num_new_tokens, request.num_prompt_tokens - 1)
        count = max(0, end - start)
        first_row = last_row - chunk.num_new_tokens + 1
        logits = self.model.compute_logits(hidden[first_row : first_row + count]).cpu()
        targets = torch.tensor(seq.token_ids[start + 1 : end + 1], dtype=torch.long)
        num_top = [request.params.prompt_logprobs or 0] * count
        return PromptLogprobs(index, start, token_logprobs(logits, targets, num_top))
