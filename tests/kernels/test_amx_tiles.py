"""bfloat16 weights packed for AMX tiles (kernels/amx_tiles.py): the layout round-trips, and
the vocabulary head on the tiles gives F.linear's bfloat16 logits with a row's bits the same
alone or among others. (The experts on the tiles: tests/kernels/test_fused_experts.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagefleet.engine.layers.logits import LogitsHead
from pagefleet.kernels import amx_tiles, cpu_ops


def _head(tied: bool, out_features: int = 96) -> LogitsHead:
    head = LogitsHead(64, out_features, tied=tied)
    head.weight.data = torch.randn(out_features, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    return head


def test_packing_round_trips() -> None:
    w = torch.randn(48, 96).bfloat16()
    packed = amx_tiles.pack_for_tiles(w)
    assert packed.shape == w.shape and not torch.equal(packed, w)
    assert torch.equal(amx_tiles.unpack_from_tiles(packed), w)


def test_an_untied_head_on_the_tiles_gives_bfloat16_logits_and_keeps_a_rows_bits() -> None:
    assert cpu_ops.load(), "g++ and ninja are on every machine here: the operators must build"
    if not amx_tiles.fits(64, 96, torch.bfloat16):
        pytest.skip("no AMX tiles on this CPU: the head stays on oneDNN")
    head = _head(tied=False)
    weight = head.weight.detach().clone()
    head.pack()
    assert head.tiles
    hidden = torch.randn(
        40, 64, generator=torch.Generator().manual_seed(1)
    ).bfloat16()  # 2 blocks of 32 rows, 1 partial
    logits = head(hidden).clone()
    assert logits.dtype == torch.float32 and logits.shape == (40, 96)
    # F.linear sums in another order: within one bfloat16 rounding step of its logits.
    torch.testing.assert_close(logits, F.linear(hidden, weight).float(), atol=0.0, rtol=2**-7)
    assert torch.equal(logits.bfloat16().float(), logits), "logits rounded to bfloat16, as the dtype's matmul"
    for row in (0, 17, 39):
        assert torch.equal(head(hidden[row : row + 1])[0], logits[row]), f"row {row} changed with the batch"


def test_a_tied_head_keeps_its_rows_for_the_embedding() -> None:
    head = _head(tied=True)
    weight = head.weight.detach().clone()
    head.pack()
    assert not head.tiles and torch.equal(head.weight, weight)
