"""Inputs of the state kernels' tests (the selective scans and the chunked gated delta rule):
flat batches of sequences, each with its own state slot, and their rows."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

Rows = tuple[torch.Tensor, ...]  # per-row tensors, each [T, ...]


def chunked_batch(
    lengths: Sequence[int], slots: Sequence[int], has_state: Sequence[bool], positions: Sequence[int]
) -> Rows:
    """(query_start int32 [N + 1], slots int64 [N], has_state bool [N], start_positions int64 [N])."""
    query_start = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return query_start, torch.tensor(slots), torch.tensor(has_state, dtype=torch.bool), torch.tensor(positions)


def starts(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each sequence's rows in a batch of these lengths."""
    return list(itertools.pairwise((0, *itertools.accumulate(lengths))))


def take(rows: Rows, start: int, end: int) -> Rows:
    return tuple(tensor[start:end] for tensor in rows)


def cat(parts: Sequence[Rows]) -> Rows:
    return tuple(torch.cat(tensors) for tensors in zip(*parts, strict=True))


def gated_delta_rows(
    num_rows: int, heads: tuple[int, int], dims: tuple[int, int], dtype: torch.dtype, seed: int
) -> Rows:
    """(query, key, value, g, beta) of the gated delta rule: `heads` (key heads, value heads),
    `dims` (key dim, value dim); g float32 log decays <= 0, beta in (0, 1)."""
    (key_heads, value_heads), (key_dim, value_dim) = heads, dims
    generator = torch.Generator().manual_seed(seed)
    query, key = (torch.randn(num_rows, key_heads, key_dim, generator=generator).to(dtype) for _ in range(2))
    value = torch.randn(num_rows, value_heads, value_dim, generator=generator).to(dtype)
    g = -F.softplus(torch.randn(num_rows, value_heads, generator=generator))
    beta = torch.sigmoid(torch.randn(num_rows, value_heads, generator=generator)).to(dtype)
    return query, key, value, g, beta


def scan_inputs(rows: Rows, params: Rows) -> Rows:
    """(x, dt, A, B, C, D, dt_bias): the scan's first arguments, in its order, from rows
    (x, dt, B, C) and params (A, D, dt_bias)."""
    (x, dt, B, C), (A, D, dt_bias) = rows, params
    return x, dt, A, B, C, D, dt_bias


def packed_scan_rows(rows: Rows) -> Rows:
    """x, dt, B and C as the layer passes them: views into one [T, x | B | C | dt] tensor,
    rows strided by its width."""
    x, dt, B, C = rows
    packed = torch.cat([x.flatten(1), B.flatten(1), C.flatten(1), dt], dim=1)
    x_view, B_view, C_view, dt_view = packed.split([x[0].numel(), B[0].numel(), C[0].numel(), dt.shape[1]], dim=1)
    return x_view.view(x.shape), dt_view, B_view.view(B.shape), C_view.view(C.shape)
