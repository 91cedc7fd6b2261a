"""Turns a schedule plan into one forward pass over a flat token batch and samples.

Owns the device KV cache (K and V tensors shaped [num_blocks, block_size, num_kv_heads,
head_dim], one pair per layer of a KV cache group, which the groups' layers share: see
engine/core/kv_groups.py) and the host pool used for swapping. With tensor parallelism, rank 0's runner
builds each step's `StepInputs` and sends them to the workers in one broadcast; every rank
runs `forward` on its part of the model and KV heads, and rank 0 samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagefleet.engine.core.kv_cache_manager import PendingCopies
from pagefleet.engine.core.kv_groups import KVGroups
from pagefleet.engine.distributed.shard import Shard
from pagefleet.engine.kv_connector.worker import load_blocks
from pagefleet.engine.layers.attention import AttentionBackend, PrefillSpan, StepLayout, allocate_kv_cache
from pagefleet.engine.layers.latent_prefill import prepare_latent_step
from pagefleet.engine.layers.rotary import rope_rows
from pagefleet.engine.lora.manager import LoRAManager
from pagefleet.engine.models.config import ModelConfig
from pagefleet.engine.models.loading import CausalLM
from pagefleet.engine.sample.sampler import Sampler, SampleResult, TokenLogprobs, token_logprobs
from pagefleet.engine.worker.state_cache import StateCache, StateMetadata
from pagefleet.engine.worker.step_input import ChunkInput, RunnerInput, SampleInput, SamplingState

if TYPE_CHECKING:
    from pagefleet.engine.distributed.workers import Workers

logger = logging.getLogger(__name__)

KVPair = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class PromptLogprobs:
    start_position: int  # the chunk's first position; position p scores prompt token p + 1
    values: TokenLogprobs  # one row per position of the chunk that has a next prompt token


@dataclass(slots=True)
class Verified:
    """A sequence's drafts after verification: `num_accepted` of `num_drafted` matched what
    sampling chose at their positions; `tokens` are the tokens sampled after the first
    one, in order (the accepted drafts' successors: the last is the correction or bonus
    token), each as (result, row)."""

    num_drafted: int
    num_accepted: int = 0
    tokens: list[tuple[SampleResult, int]] = field(default_factory=list)


@dataclass(slots=True)
class RequestResults:
    """One request's part of a step: its sampled rows and prompt logprobs, or the error
    that its own part raised (the forward pass is shared; sampling is per request)."""

    samples: list[int] = field(default_factory=list)  # indices into the step's samples
    rows: list[int] = field(default_factory=list)  # rows[i]: the row of samples[i] in `sampled`
    sampled: SampleResult | None = None
    prompt_logprobs: PromptLogprobs | None = None
    verified: dict[int, Verified] = field(default_factory=dict)  # by sample index, with drafts
    error: Exception | None = None


@dataclass(slots=True)
class StepInputs:
    """What every rank needs for one forward pass (sent to tensor-parallel workers whole)."""

    copies: PendingCopies
    input_ids: torch.Tensor
    positions: torch.Tensor  # each token's row of the position tables: its position, or LongRoPE's long row
    layouts: list[StepLayout]  # per KV cache group
    logit_rows: list[int]  # rows whose logits are computed: samples first, then prompt logprobs
    state: StateMetadata | None = None  # the state layers' view of the chunks (models with them)


def cache_layer_shapes(config: ModelConfig, shard: Shard | None = None) -> list[tuple[int, int]]:
    """Per cache layer (`ModelConfig.cache_layers`), (KV heads on this rank, head dim)."""
    shard = shard or Shard()
    shapes = (config.layer_kv_shape(layer) for layer in config.cache_layers)
    return [(shard.kv_heads(config.num_heads, heads)[1], head_dim) for heads, head_dim in shapes]


def tensor_pages(config: ModelConfig, groups: KVGroups, block_size: int, shard: Shard | None = None) -> list[int]:
    """Per cache tensor index, the elements of one block's keys (or values): its layers'
    page, the largest where their shapes differ (Gemma 4's global and sliding layers share
    an index: each block id has one page, padded to the larger shape)."""
    pages = [0] * groups.num_tensors
    for tensor, (heads, head_dim) in zip(groups.layer_tensors, cache_layer_shapes(config, shard), strict=True):
        pages[tensor] = max(pages[tensor], block_size * heads * head_dim)
    return pages


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, shard: Shard | None = None, groups: KVGroups | None = None
) -> int:
    """Bytes of one block id on one rank (its KV heads only): a page of keys and one of
    values in every cache tensor of `groups` (default: every cache layer's own, as without
    KV cache groups); latent attention's one page is both."""
    element = torch.empty((), dtype=dtype).element_size()
    groups = groups or KVGroups.of(config.cache_layer_windows, hybrid=False)
    pages_per_tensor = 1 if config.mla else 2
    return pages_per_tensor * element * sum(tensor_pages(config, groups, block_size, shard))


def padded_view(pages: torch.Tensor, block_size: int, heads: int, head_dim: int) -> torch.Tensor:
    """A layer's cache [num_blocks, block_size, heads, head_dim] over padded pages
    [num_blocks, 1, 1, page]: block-major, head-major within each block (the kernels take
    any strides; the torch reference reads it block by block)."""
    strides = (pages.stride(0), head_dim, block_size * head_dim, 1)
    return pages.as_strided((pages.shape[0], block_size, heads, head_dim), strides, pages.storage_offset())


def state_chunk_size(model_config: ModelConfig, backend: AttentionBackend, block_size: int) -> int:
    """The chunk of a state layer's chunked form (the gated delta rule's, Mamba-2's scan's):
    a block on the Triton kernels (the scheduler then cuts such prompts at block multiples:
    KVCacheManager.chunk_end), 0 (token by token) elsewhere."""
    return block_size if model_config.linear_attention is not None and backend.name == "triton" else 0


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        model_config: ModelConfig,
        groups: KVGroups,
        backend: AttentionBackend,
        num_blocks: int,
        num_host_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        shard: Shard,
        lora: LoRAManager | None = None,
        workers: Workers | None = None,
        state_rows: tuple[int, int, int] = (0, 0, 0),
        expand_latent_prefill: bool = False,
    ) -> None:
        """`state_rows`: a model with state layers' running slots, prefix snapshots and host
        slots for swapping. `expand_latent_prefill`: EngineConfig.mla_prefill="expanded"."""
        self.model, self.model_config, self.groups, self.backend = model, model_config, groups, backend
        self.lora = lora  # with enable_lora
        self.workers = workers  # rank 0 of a tensor-parallel group: the other ranks
        self.block_size, self.device = block_size, device

        def cache_pair(blocks: int, shape: tuple[int, int, int], where: torch.device | str) -> KVPair:
            keys = allocate_kv_cache(blocks, *shape, dtype, where)
            # Latent attention caches one head that is keys and values at once.
            return keys, keys if model_config.mla else allocate_kv_cache(blocks, *shape, dtype, where)

        # Per tensor index, its layers' shape, or for layers of several shapes a page that
        # holds the largest (`tensor_pages`).
        shapes = cache_layer_shapes(model_config, shard)
        pages = tensor_pages(model_config, groups, block_size, shard)
        padded = [
            len({s for t, s in zip(groups.layer_tensors, shapes, strict=True) if t == i}) > 1
            for i in range(groups.num_tensors)
        ]
        tensor_shapes = [
            (1, 1, pages[i]) if padded[i] else (block_size, *shapes[groups.layer_tensors.index(i)])
            for i in range(groups.num_tensors)
        ]
        # The tensor pairs (copies and swaps run over these), each cache layer's view (the KV
        # connectors move these), and each model layer's (a KV-shared layer's is its source's).
        self.kv_tensors = [cache_pair(num_blocks, shape, device) for shape in tensor_shapes]
        self.cache_layer_caches = []
        for tensor, shape in zip(groups.layer_tensors, shapes, strict=True):
            keys, values = self.kv_tensors[tensor]
            if padded[tensor]:
                keys, values = padded_view(keys, block_size, *shape), padded_view(values, block_size, *shape)
            self.cache_layer_caches.append((keys, values))
        num_slots, num_snapshots, num_host_slots = state_rows
        self.state_cache = StateCache(model_config, num_slots + num_snapshots, dtype, device) if num_slots else None
        self.host_state_cache = StateCache(model_config, num_host_slots, dtype, "cpu") if num_host_slots else None
        self.state_chunk_size = state_chunk_size(model_config, backend, block_size)
        self.expand_latent_prefill = expand_latent_prefill
        self.kv_caches, self.layer_groups = self._model_layer_caches()
        self.host_tensors = [cache_pair(num_host_blocks, s, "cpu") for s in tensor_shapes] if num_host_blocks else []
        self.sampler = Sampler(model_config.eos_token_ids, seed)

    def _run_state_copies(self, copies: PendingCopies) -> None:
        """Snapshots, prefix hits and forks first (queued when the last step ended, before
        this step's swaps and loads chose their slots: a snapshot reads a slot that a
        sequence which just finished left, and that a load may now fill), then remote
        prefixes' states (into fresh slots), then swap-outs, then swap-ins."""
        if self.state_cache is None:
            return
        self.state_cache.copy(copies.state)
        self.state_cache.load(copies.state_loads)
        if self.host_state_cache is not None:
            self.host_state_cache.copy(copies.state_swap_out, self.state_cache)
            self.state_cache.copy(copies.state_swap_in, self.host_state_cache)

    def _model_layer_caches(self) -> tuple[list[KVPair], list[int | None]]:
        """Per model layer, its cache and KV cache group: a KV-shared layer's are its
        source's; a state layer's "cache" is its pair of state tensors, its metadata the
        step's `StateMetadata` (group None)."""
        config = self.model_config
        cache_index = {layer: i for i, layer in enumerate(config.cache_layers)}
        caches: list[KVPair] = []
        groups: list[int | None] = []
        for layer in range(config.num_layers):
            if self.state_cache is not None and config.is_state_layer(layer):
                caches.append(self.state_cache.layers[layer])
                groups.append(None)
            else:
                index = cache_index[config.kv_source(layer)]
                caches.append(self.cache_layer_caches[index])
                groups.append(self.groups.layer_groups[index])
        return caches, groups

    def run_copies(self, copies: PendingCopies) -> None:
        """Swap-outs first (their device blocks may be reused below), then swap-ins, then
        the connectors' loads (KV from outside), then copy-on-write copies."""
        for pairs, source, target in (
            (copies.swap_out, self.kv_tensors, self.host_tensors),
            (copies.swap_in, self.host_tensors, self.kv_tensors),
        ):
            if not pairs:
                continue
            src = torch.tensor([p[0] for p in pairs])
            dst = torch.tensor([p[1] for p in pairs])
            for (src_k, src_v), (dst_k, dst_v) in zip(source, target, strict=True):
                dst_k[dst.to(dst_k.device)] = src_k[src.to(src_k.device)].to(dst_k.device)
                dst_v[dst.to(dst_v.device)] = src_v[src.to(src_v.device)].to(dst_v.device)
        load_blocks(self.cache_layer_caches, copies.loads)
        self._run_state_copies(copies)
        if copies.device:
            mapping = torch.tensor(copies.device, dtype=torch.int64, device=self.device)
            for key_cache, value_cache in self.kv_tensors:
                self.backend.copy_blocks(key_cache, value_cache, mapping)

    @torch.inference_mode()
    def execute(self, plan: RunnerInput) -> dict[str, RequestResults]:
        """Run the step's copies, then the forward pass for its chunks (in batch order),
        then its samples and prompt logprobs.

        Returns each request's results by request id. A failure of the forward pass raises
        (every request shares it); a failure in one request's sampling or prompt logprobs
        is that request's `error`.
        """
        chunks, samples = plan.chunks, plan.samples
        input_ids, positions, layouts, last_rows = self._build_batch(chunks)
        own_rows = [last_rows[s.chunk_index] - len(s.draft_token_ids) for s in samples]
        logit_rows = list(own_rows)
        prompt_spans = {}  # chunk index -> its rows among the logits
        for index in plan.prompt_logprob_chunks:
            first_row, count = self._prompt_rows(chunks[index], last_rows[index])
            prompt_spans[index] = (len(logit_rows), len(logit_rows) + count)
            logit_rows.extend(range(first_row, first_row + count))
        draft_spans = {}  # sample index -> its draft positions' rows among the logits
        for index, (sample, row) in enumerate(zip(samples, own_rows, strict=True)):
            if sample.draft_token_ids:
                draft_spans[index] = len(logit_rows)
                logit_rows.extend(range(row + 1, row + 1 + len(sample.draft_token_ids)))
        state = StateMetadata.of(chunks, self.device, self.state_chunk_size) if self.state_cache is not None else None
        step = StepInputs(plan.copies, input_ids, positions, layouts, logit_rows, state)
        if self.workers is not None:
            self.workers.send(step)
        if self.lora is not None:
            self.lora.set_batch([(c.lora_slot, c.num_new_tokens) for c in chunks])
        logits = self.forward(step)
        results: dict[str, RequestResults] = {}

        def results_of(chunk_index: int) -> RequestResults:
            return results.setdefault(chunks[chunk_index].request_id, RequestResults())

        if samples:
            assert logits is not None
            owners = [results_of(s.chunk_index) for s in samples]
            self._sample(logits[: len(samples)], samples, owners)
            if draft_spans:
                self._verify(logits, samples, owners, draft_spans)
        for index, (start, end) in prompt_spans.items():
            owner = results_of(index)
            try:
                assert logits is not None
                owner.prompt_logprobs = self._prompt_logprobs(logits[start:end], chunks[index])
            except Exception as error:  # this request's own work: it fails alone
                owner.error = error
        return results

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor | None:
        """One step on this rank: the copies, the forward pass, and the float32 logits of
        `step.logit_rows` on the CPU (None on a tensor-parallel worker)."""
        self.run_copies(step.copies)
        if self.expand_latent_prefill:
            group_metadata = [prepare_latent_step(layout, self.backend, self.block_size) for layout in step.layouts]
        else:
            group_metadata = [self.backend.prepare(layout) for layout in step.layouts]
        metadata = [step.state if group is None else group_metadata[group] for group in self.layer_groups]
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, metadata, self.backend)
        if not step.logit_rows:
            return None
        rows = torch.tensor(step.logit_rows, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return logits.cpu() if logits is not None else None

    def _sample(self, logits: torch.Tensor, samples: list[SampleInput], owners: list[RequestResults]) -> None:
        """Sample every row in one batch. If the batch fails, sample each request alone,
        so that only the request at fault fails and the others keep their tokens."""
        states, params = [s.state for s in samples], [s.params for s in samples]
        try:
            result = self.sampler(logits, states, params)
        except Exception:
            logger.warning("batched sampling failed; sampling each request alone", exc_info=True)
            groups: dict[int, list[int]] = {}
            for index, owner in enumerate(owners):
                groups.setdefault(id(owner), []).append(index)
            for indices in groups.values():
                owner = owners[indices[0]]
                try:
                    alone = self.sampler(logits[indices], [states[i] for i in indices], [params[i] for i in indices])
                except Exception as error:  # this request's own parameters: it fails alone
                    owner.error = error
                    continue
                owner.samples, owner.rows, owner.sampled = indices, list(range(len(indices))), alone
            return
        for row, owner in enumerate(owners):
            owner.samples.append(row)
            owner.rows.append(row)
            owner.sampled = result

    def _verify(
        self,
        logits: torch.Tensor,
        samples: list[SampleInput],
        owners: list[RequestResults],
        draft_spans: dict[int, int],
    ) -> None:
        """Walk each sequence's drafts position by position: a draft is accepted when the
        token sampled at its position (from the logits before it, with every penalty and
        constraint applied to the sequence as if the drafts before it were its own) is
        the draft itself; the first mismatch, or the position after the last draft, gives
        one more token, sampled there. Every emitted token is thus drawn from exactly the
        distribution it has without speculation, and a seeded request draws its random
        numbers in the same order (one per emitted token): the same output either way. A
        constrained sequence's mask at each position is its grammar's after the drafts
        before it (`draft_allowed`). Positions after a mismatch are never sampled."""
        walking = []  # (sample index, its Verified) still matching
        for index in draft_spans:
            owner, sample = owners[index], samples[index]
            if owner.sampled is None or owner.error is not None:
                continue
            verified = owner.verified.setdefault(index, Verified(len(sample.draft_token_ids)))
            row = next(r for i, r in zip(owner.samples, owner.rows, strict=True) if i == index)
            if owner.sampled.token_ids[row] == sample.draft_token_ids[0]:
                walking.append((index, verified))
        position = 0
        while walking:
            position += 1
            states, params, rows = [], [], []
            for index, verified in walking:
                verified.num_accepted += 1
                sample = samples[index]
                state = sample.state
                # As if the accepted drafts were its own tokens:
                tokens = [*state.token_ids, *sample.draft_token_ids[:position]]
                allowed = sample.draft_allowed[position - 1] if sample.draft_allowed else None
                states.append(SamplingState(tokens, state.num_prompt_tokens, state.generator, allowed))
                params.append(sample.params)
                rows.append(draft_spans[index] + position - 1)
            try:
                result = self.sampler(logits[rows], states, params)
            except Exception:  # the tokens emitted so far stand; this position is not taken
                logger.warning("sampling a draft position failed; keeping the tokens before it", exc_info=True)
                return
            still = []
            for row, (index, verified) in enumerate(walking):
                verified.tokens.append((result, row))
                drafts = samples[index].draft_token_ids
                if position < len(drafts) and result.token_ids[row] == drafts[position]:
                    still.append((index, verified))
            walking = still

    def _build_batch(self, chunks: list[ChunkInput]) -> tuple[torch.Tensor, torch.Tensor, list[StepLayout], list[int]]:
        """The flat batch of `chunks` and its attention layout in each KV cache group."""
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        max_positions = self.model_config.max_position_embeddings
        for chunk in chunks:
            last_rows.append(len(input_ids) + chunk.num_new_tokens - 1)
            input_ids.extend(chunk.input_token_ids)
            positions.extend(rope_rows(chunk.start, chunk.end, chunk.long_rope, max_positions))
        layouts = [self._layout(chunks, group) for group in range(self.groups.num_groups)]
        return (
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            layouts,
            last_rows,
        )

    def _layout(self, chunks: list[ChunkInput], group: int) -> StepLayout:
        """Where every row of the step writes and reads in `group`'s blocks."""
        bs = self.block_size
        slots: list[int] = []
        decode_context, decode_tables = [], []
        prefills: list[PrefillSpan] = []
        prompt_decodes: list[PrefillSpan] = []
        row = 0
        for chunk in chunks:
            start, end = chunk.start, chunk.end
            # A sliding group's freed places (NULL_BLOCK, -1) are never read unmasked: the
            # kernels' tables and the context slots take block 0 for them.
            table = chunk.block_tables[group][: (end + bs - 1) // bs]
            if chunk.num_own_tokens == 1:
                # A decode, and each of its drafts' rows a decode of its own: a verified
                # position is attended exactly as it would be without speculation.
                assert not prefills, "decode chunks must come before prefill chunks"
                for position in range(start, end):
                    slots.append(table[position // bs] * bs + position % bs)
                    decode_context.append(position + 1)
                    decode_tables.append(table)
                if self.expand_latent_prefill and start < chunk.num_prompt_tokens:
                    prompt_decodes.append(self._span(chunk, table, row))
            else:
                span = self._span(chunk, table, row)
                slots.extend(span.context_slots[start:end].tolist())
                prefills.append(span)
            row += chunk.num_new_tokens
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        return StepLayout(slot_mapping, decode_context, decode_tables, prefills, prompt_decodes)

    def _span(self, chunk: ChunkInput, table: list[int], row: int) -> PrefillSpan:
        """`chunk` as a prefill span from `row`, with the cache slot of every context position."""
        bs, end = self.block_size, chunk.end
        pos = np.arange(end)
        context_slots = np.maximum(np.asarray(table, dtype=np.int64), 0)[pos // bs] * bs + pos % bs
        return PrefillSpan(row, chunk.num_new_tokens, end, table, context_slots, chunk.num_prompt_tokens)

    @staticmethod
    def _prompt_rows(chunk: ChunkInput, last_row: int) -> tuple[int, int]:
        """(first row, count) of the chunk's positions that score a next prompt token (one
        per target: the prompt's last position predicts none)."""
        return last_row - chunk.num_new_tokens + 1, len(chunk.prompt_targets)

    def _prompt_logprobs(self, logits: torch.Tensor, chunk: ChunkInput) -> PromptLogprobs:
        """Logprobs of the prompt tokens that follow each scoring position of `chunk`."""
        targets = torch.tensor(chunk.prompt_targets, dtype=torch.long)
        return PromptLogprobs(chunk.start, token_logprobs(logits, targets, [chunk.num_prompt_top] * len(targets)))
