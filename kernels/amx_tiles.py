"""bfloat16 weights packed for AMX tiles: the routed experts (csrc/cpu_experts_packed.h)
and the vocabulary head (csrc/cpu_tiles.cpp), both on `multiply_packed` (cpu_experts_amx.h).

`tdpbf16ps` multiplies a tile of 16 rows by 32 values with one of 16 pairs of values by 16
columns. Packed once at load, a projection's weights are that second operand tile by tile,
so the tokens are the first as their rows lie and each result tile is 16 tokens by 16
outputs, stored row by row: no transposes on either side at every step. Packing only moves
values; each output is one chain over k in order, whatever the rows beside it:

    w [N, K] -> [N/16, K/32, 16 (pairs of k), 16 (outputs), 2]   (1 KiB a tile, in k order)

Experts are stacked along N in whole tiles, so a stacked matrix packs as one.
"""

from __future__ import annotations

import torch

from pagefleet.kernels import cpu_ops

TILE_ROWS, TILE_DEPTH = 16, 32


def fits(size: int, outputs: int, dtype: torch.dtype) -> bool:
    """Whether bfloat16 weights [outputs, size] run on AMX tiles on this CPU (the compiled
    operators loading, built on first use), and so are served packed."""
    return dtype == torch.bfloat16 and cpu_ops.load() and bool(torch.ops.pagefleet.amx_tiles_fit(size, outputs))


def pack_for_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] (N a multiple of 16, K of 32) -> its packed layout, same shape."""
    rows, size = w.shape
    tiles = w.view(rows // TILE_ROWS, TILE_ROWS, size // TILE_DEPTH, TILE_DEPTH // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous().view(rows, size)


def unpack_from_tiles(packed: torch.Tensor) -> torch.Tensor:
    """pack_for_tiles' inverse: the row-major weights (for the plain-torch reference)."""
    rows, size = packed.shape
    tiles = packed.view(rows // TILE_ROWS, size // TILE_DEPTH, TILE_DEPTH // 2, TILE_ROWS, 2)
    return tiles.permute(0, 3, 1, 2, 4).contiguous().view(rows, size)
