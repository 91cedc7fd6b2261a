"""Batched LoRA for a batch that mixes adapters: each token row applies its own adapter.

    shrink: out[t] = x[t] @ a[slot[t]].T          a: [slots, rank, in]   -> out: [tokens, rank] (float32)
    expand: y[t] += xa[t] @ b[slot[t]].T          b: [slots, out, rank]  (y updated in place)

A row whose slot is -1 (the base model) gets zeros from shrink and is left alone by expand.
One program per (token, output tile), like punica's BGMV; the adapter's rank is small
(8-64 per projection), so a token's whole rank is one tile. `lora_shrink_torch` and
`lora_expand_torch` are the references: they group the rows by slot and do two matmuls
per adapter in the batch. The CPU path (engine/lora/layer.py) does the same sums on runs
of consecutive rows, in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagefleet.kernels.checks import INDEX_DTYPES, KernelArgumentError, check_tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    slots_ptr,
    out_ptr,
    in_features,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ot,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        for start in range(0, in_features, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * stride_xt + ks, mask=ks < in_features, other=0.0).to(tl.float32)
            a_mask = (ranks[:, None] < rank) & (ks[None, :] < in_features)
            a = tl.load(a_ptr + slot * stride_as + ranks[:, None] * stride_ar + ks[None, :], mask=a_mask, other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + token * stride_ot + ranks, acc.to(out_ptr.dtype.element_ty), mask=ranks < rank)


@triton.jit
def _lora_expand_kernel(
    xa_ptr,
    b_ptr,
    slots_ptr,
    y_ptr,
    out_features,
    rank,
    stride_xat,
    stride_bs,
    stride_bo,
    stride_br,
    stride_yt,
    BLOCK_R: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    token = tl.program_id(0)
    tile = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        outs = tile * BLOCK_O + tl.arange(0, BLOCK_O)
        ranks = tl.arange(0, BLOCK_R)
        xa = tl.load(xa_ptr + token * stride_xat + ranks, mask=ranks < rank, other=0.0).to(tl.float32)
        b_mask = (outs[:, None] < out_features) & (ranks[None, :] < rank)
        b_offsets = slot * stride_bs + outs[:, None] * stride_bo + ranks[None, :] * stride_br
        b = tl.load(b_ptr + b_offsets, mask=b_mask, other=0.0)
        delta = tl.sum(b.to(tl.float32) * xa[None, :], axis=1)
        y = tl.load(y_ptr + token * stride_yt + outs, mask=outs < out_features, other=0.0)
        tl.store(y_ptr + token * stride_yt + outs, (y.to(tl.float32) + delta).to(y.dtype), mask=outs < out_features)


def _check(x: torch.Tensor, stack: torch.Tensor, slots: torch.Tensor, stack_name: str) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor(stack_name, stack, 3, FLOAT_DTYPES, x.device, unit_last_stride=stack_name == "a")
    check_tensor("slots", slots, 1, INDEX_DTYPES, x.device)
    if slots.shape[0] != x.shape[0]:
        raise KernelArgumentError(f"slots: one per token row, got {slots.shape[0]} for {x.shape[0]} rows")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x: [tokens, in], a: [slots, rank, in], slots: [tokens] (-1: none) -> [tokens, rank] float32."""
    _check(x, a, slots, "a")
    if a.shape[2] != x.shape[1]:
        raise KernelArgumentError(f"a: expected in_features {x.shape[1]}, got {a.shape[2]}")
    out = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return out
    rank = a.shape[1]
    _lora_shrink_kernel[(x.shape[0],)](
        x,
        a,
        slots,
        out,
        x.shape[1],
        rank,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        out.stride(0),
        BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_K=min(128, triton.next_power_of_2(x.shape[1])),
    )
    return out


def lora_expand(xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor) -> None:
    """y[t] += xa[t] @ b[slots[t]].T in place; xa: [tokens, rank], b: [slots, out, rank] (any
    strides: the engine keeps B as [slots, rank, out] and passes its transpose)."""
    _check(xa, b, slots, "b")
    check_tensor("y", y, 2, FLOAT_DTYPES, xa.device)
    if b.shape[2] != xa.shape[1] or y.shape != (xa.shape[0], b.shape[1]):
        raise KernelArgumentError(f"b {tuple(b.shape)} and y {tuple(y.shape)} do not fit xa {tuple(xa.shape)}")
    if xa.shape[0] == 0:
        return
    block_o = min(128, triton.next_power_of_2(b.shape[1]))
    _lora_expand_kernel[(xa.shape[0], triton.cdiv(b.shape[1], block_o))](
        xa,
        b,
        slots,
        y,
        b.shape[1],
        b.shape[2],
        xa.stride(0),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        y.stride(0),
        BLOCK_R=triton.next_power_of_2(b.shape[2]),
        BLOCK_O=block_o,
    )


def _slot_rows(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its token rows) for every slot >= 0 in `slots`."""
    present = torch.unique(slots[slots >= 0]).tolist()
    return [(int(slot), torch.nonzero(slots == slot).flatten()) for slot in present]


def lora_shrink_torch(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, rows in _slot_rows(slots):
        out[rows] = (x[rows] @ a[slot].T).float()
    return out


def lora_expand_torch(xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor) -> None:
    for slot, rows in _slot_rows(slots):
        y.index_add_(0, rows, (xa[rows].to(b.dtype) @ b[slot].T).to(y.dtype))
