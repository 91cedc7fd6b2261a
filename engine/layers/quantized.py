"""Weights kept in GGML's block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) and
the matmul that reads them.

A block is 32 weights of one output row: Q4_0/Q4_1 store an unsigned nibble per weight, a
float16 scale `d` and (Q4_1) a float16 min `m` (w = d * u + m; Q4_0 is u - 8, so its min
is -8 d); Q5_0/Q5_1 the same with a fifth bit per weight kept apart (Q5_0 is u - 16);
Q8_0 stores a signed byte per weight and `d` (w = d * q). Q4_K and Q5_K group 8 such
blocks in a super-block of 256 with one float16 `d` and `dmin` and a 6-bit scale and min
per block (w = d * sc * u - dmin * m); Q6_K stores 6 bits a weight and a signed 8-bit scale
per 16 weights under one float16 `d` (w = d * sc * (u - 32)). At load the blocks are split
into three arrays (nibbles or bytes, scales, mins) with every weight unsigned, w = scale * u
+ min, a scale and min per group of 32 weights (16 for Q6_K):

    format        codes               formats                  group
    FOUR_BIT      two nibbles a byte  Q4_0, Q4_1, Q4_K           32
    EIGHT_BIT     a byte each         Q5_0, Q5_1, Q5_K, Q8_0     32
    EIGHT_BIT_16  a byte each         Q6_K                       16

(Q8_0: u = q + 128, min = -128 d, which VNNI's unsigned-by-signed dot product wants; the
K formats' scale d * sc and min -dmin * m are rounded to float16, at most 2^-11 of each,
far below a 4-bit step.) 5- and 6-bit codes take a byte each as loaded: exact, and what the
Triton kernel and the reference read. A CPU layer repacks them once at load for its kernel
(`for_this_device`): on AVX-512 VNNI (kernels/csrc/cpu_quant_vnni.h) 5- and 6-bit codes
become low nibbles plus planes of their high bits (`with_planes`: Q6_K 1.25 -> 0.875 bytes
a weight with its derived mins dropped; a Q4_K_M file's head and down experts are Q6_K, the
bytes a decode step reads most), the others stay as loaded; on AVX2 every format is repacked with 8
output columns interleaved (`PackedWeight`). Either way one kernel serves every number of
rows. `quantized_linear_torch`, the oracle and the fallback,
dequantizes and multiplies in float32; every dequantized value is exact (a float16 times at
most 8 bits, plus a min).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from pagefleet.kernels import cpu_ops

BLOCK = 32
# GGML's type ids (gguf.GGMLQuantizationType) of the formats read as stored.
GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0 = 2, 3, 6, 7, 8
GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 12, 13, 14
GGML_NAMES = {
    GGML_Q4_0: "Q4_0",
    GGML_Q4_1: "Q4_1",
    GGML_Q5_0: "Q5_0",
    GGML_Q5_1: "Q5_1",
    GGML_Q8_0: "Q8_0",
    GGML_Q4_K: "Q4_K",
    GGML_Q5_K: "Q5_K",
    GGML_Q6_K: "Q6_K",
}
# Each format's stored block: (weights, bytes).
GGML_BLOCKS = {
    GGML_Q4_0: (32, 18),
    GGML_Q4_1: (32, 20),
    GGML_Q5_0: (32, 22),
    GGML_Q5_1: (32, 24),
    GGML_Q8_0: (32, 34),
    GGML_Q4_K: (256, 144),
    GGML_Q5_K: (256, 176),
    GGML_Q6_K: (256, 210),
}
# The operator's layouts (`format` in cpu_quant.cpp): three as loaded, two of the VNNI
# kernel's own (`QuantizedWeight.with_planes`).
FOUR_BIT, EIGHT_BIT, EIGHT_BIT_16, SIX_BIT_PLANES_16, FIVE_BIT_PLANES = 0, 1, 2, 3, 4
_FORMATS = {GGML_Q4_0: FOUR_BIT, GGML_Q4_1: FOUR_BIT, GGML_Q4_K: FOUR_BIT, GGML_Q6_K: EIGHT_BIT_16}
_PLANES = {GGML_Q5_0: 1, GGML_Q5_1: 1, GGML_Q5_K: 1, GGML_Q6_K: 2}  # high bits above the nibble


@dataclass(frozen=True)
class QuantizedWeight:
    """An [out_features, in_features] weight in blocks of 32 along in_features.

    quants: uint8 [out, in / 2] (FOUR_BIT: block b's 16 bytes hold its elements 0-15 in the
    low nibbles, 16-31 in the high) or [out, in] (a byte a weight); scales, mins: float16
    [out, in / group]; w = scale * u + min. With `planes` (5- and 6-bit codes in the VNNI
    kernel's layout), quants is [out, in / 2 + in * planes / 8]: the codes' low nibbles in the
    4-bit layout, then per pair of blocks 8 bytes a plane of their high bits (byte j: the
    high bits of pair positions j + 8i at bit i, or j + 16i at bits 2i, 2i + 1; pair
    positions 0-15 are block 2p's elements 0-15, 16-31 block 2p + 1's, 32-47 2p's 16-31,
    48-63 2p + 1's 16-31), and Q6_K's mins are empty [out, 0]: -32 times its scales."""

    ggml_type: int
    quants: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    planes: bool = False

    @property
    def format(self) -> int:
        if self.planes:
            return SIX_BIT_PLANES_16 if self.ggml_type == GGML_Q6_K else FIVE_BIT_PLANES
        return _FORMATS.get(self.ggml_type, EIGHT_BIT)

    @property
    def group(self) -> int:
        """Weights sharing a scale and a min."""
        return 16 if self.ggml_type == GGML_Q6_K else BLOCK

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.mins))

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, ggml_type: int) -> QuantizedWeight:
        """From GGUF's bytes: uint8 [out_features, in_features / block weights * block bytes]."""
        rows = blocks.shape[0]
        blocks = blocks.reshape(rows, -1, GGML_BLOCKS[ggml_type][1])
        if ggml_type in (GGML_Q4_K, GGML_Q5_K, GGML_Q6_K):
            unsigned, scales, mins = _K_READERS[ggml_type](blocks)
        else:
            unsigned, scales, mins = _read_block_32(blocks, ggml_type)
        if ggml_type in (GGML_Q4_0, GGML_Q4_1, GGML_Q4_K):  # the 4-bit layout: 0-15 low, 16-31 high
            unsigned = unsigned.reshape(rows, -1, BLOCK)
            unsigned = unsigned[..., :16] | (unsigned[..., 16:] << 4)
        return cls(
            ggml_type,
            unsigned.reshape(rows, -1).contiguous(),
            scales.half().reshape(rows, -1).contiguous(),
            mins.half().reshape(rows, -1).contiguous(),
        )

    def to(self, device: torch.device) -> QuantizedWeight:
        return replace(self, quants=self.quants.to(device), scales=self.scales.to(device), mins=self.mins.to(device))

    def select_rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight's rows `index` (a permutation, a subset or a slice: a view), still quantized."""
        return replace(self, quants=self.quants[index], scales=self.scales[index], mins=self.mins[index])

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row blocks stacked (q, k, v -> qkv); all of one type and layout."""
        if len({(p.ggml_type, p.planes) for p in parts}) != 1:
            raise ValueError("fused weights of different GGML types")
        return replace(
            parts[0],
            quants=torch.cat([p.quants for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            mins=torch.cat([p.mins for p in parts]),
        )

    @property
    def takes_planes(self) -> bool:
        """Whether `with_planes` can hold these codes: 5- or 6-bit, in whole block pairs."""
        return not self.planes and self.ggml_type in _PLANES and self.shape[1] % (2 * BLOCK) == 0

    def with_planes(self) -> QuantizedWeight:
        """The same weights in the VNNI kernel's layout of 5- and 6-bit codes (see the class)."""
        codes = _codes(self)
        out = codes.shape[0]
        low = (codes & 0x0F).reshape(out, -1, 2, 16)
        nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(out, -1)
        # Pair positions: [out, pairs, half, block, 16] -> 64 a pair.
        high = (codes >> 4).reshape(out, -1, 2, 2, 16).transpose(2, 3).reshape(out, -1, 64)
        planes = _PLANES[self.ggml_type]
        per_byte = 8 // planes  # high bits a plane byte holds
        high = (
            high.reshape(out, -1, per_byte, 64 // per_byte)
            << (planes * torch.arange(per_byte, dtype=torch.uint8))[:, None]
        )
        plane_bytes = high.sum(dim=2, dtype=torch.uint8).reshape(out, -1)
        mins = self.mins[:, :0] if self.ggml_type == GGML_Q6_K else self.mins
        quants = torch.cat([nibbles, plane_bytes], 1).contiguous()
        return QuantizedWeight(self.ggml_type, quants, self.scales, mins, planes=True)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out_features, in_features], or only `rows` of it (an embedding lookup)."""
        weight = self if rows is None else self.select_rows(rows)
        out = weight.quants.shape[0]
        unsigned = _codes(weight).reshape(out, -1, self.group)
        scales = weight.scales.float().unsqueeze(-1)
        mins = weight.mins.float().unsqueeze(-1) if weight.mins.shape[1] else scales * -32  # Q6_K's derived mins
        return (unsigned.float() * scales + mins).reshape(out, -1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self)


def _float16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block [rows, n, bytes], as float32 [rows, n, 1]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Low nibbles, then high ones, stacked along `dim` (GGML's order of 4-bit codes)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=dim)


def _read_block_32(blocks: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 blocks [rows, n, bytes] -> unsigned codes [rows, n, 32]
    in element order, float32 scales and mins [rows, n, 1] (exact: float16 values)."""
    rows, n = blocks.shape[:2]
    scales = _float16(blocks, 0)
    if ggml_type == GGML_Q8_0:
        return blocks[..., 2:] ^ 0x80, scales, scales * -128
    with_min = ggml_type in (GGML_Q4_1, GGML_Q5_1)
    at = 4 if with_min else 2
    unsigned = _nibbles(blocks[..., at + 4 if ggml_type in (GGML_Q5_0, GGML_Q5_1) else at :], dim=2)
    unsigned = unsigned.reshape(rows, n, 32)  # elements 0-15 in the low nibbles, 16-31 in the high
    if ggml_type in (GGML_Q5_0, GGML_Q5_1):  # 4 bytes of fifth bits: element i at bit i % 8 of byte i / 8
        fifth = (blocks[..., at : at + 4, None] >> torch.arange(8, dtype=torch.uint8)) & 1
        unsigned = unsigned | (fifth.reshape(rows, n, 32) << 4)
    mins = _float16(blocks, 2) if with_min else scales * (-8.0 if ggml_type == GGML_Q4_0 else -16.0)
    return unsigned, scales, mins


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K super-blocks [rows, n, bytes]: each of the 8 blocks' scale d * sc and min
    -dmin * m, float32 [rows, n, 8] (bytes 0-15: d, dmin, twelve bytes of 6-bit sc and m, as
    llama.cpp's get_scale_min_k4)."""
    d, dmin = _float16(blocks, 0), _float16(blocks, 2)  # [rows, n, 1]
    packed = blocks[..., 4:16].long()
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([low & 63, (extra & 0xF) | ((low >> 6) << 4)], dim=-1)  # blocks 0-3, 4-7
    m = torch.cat([high & 63, (extra >> 4) | ((high >> 6) << 4)], dim=-1)
    return d * sc, -(dmin * m)


def _read_q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K: 128 bytes of nibbles after the scales; bytes 32c..32c+31 hold block 2c's
    weights in their low nibbles and block 2c+1's in their high ones."""
    rows, supers = blocks.shape[:2]
    scales, mins = _k_scales(blocks)
    unsigned = _nibbles(blocks[..., 16:].reshape(rows, supers, 4, 32), dim=3).reshape(rows, supers * 8, 32)
    return unsigned, scales, mins


def _read_q5_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q5_K: Q4_K's layout with 32 bytes of fifth bits before the nibbles (block j's at bit j
    of each byte)."""
    rows, supers = blocks.shape[:2]
    scales, mins = _k_scales(blocks)
    high = blocks[..., 16:48]  # [rows, n, 32]
    low = _nibbles(blocks[..., 48:].reshape(rows, supers, 4, 32), dim=3).reshape(rows, supers, 8, 32)
    fifth = (high[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # [rows, n, 8, 32]
    return (low | (fifth << 4)).reshape(rows, supers * 8, 32), scales, mins


def _read_q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, d. Each half
    of 128 weights: low nibbles of bytes 0-63 then their high nibbles; the high pairs of
    bytes 0-31 at bits 0, 2, 4, 6 for its four runs of 32. Per 16 weights: scale d * sc,
    min -32 d * sc."""
    rows, supers = blocks.shape[:2]
    low = _nibbles(blocks[..., :128].reshape(rows, supers, 2, 64), dim=3).reshape(rows, supers, 2, 4, 32)
    pair_shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    high = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32) >> pair_shifts[:, None]
    unsigned = (low | ((high & 3) << 4)).reshape(rows, supers * 16, 16)
    scales = _float16(blocks, 208) * blocks[..., 192:208].contiguous().view(torch.int8).float()  # [rows, n, 16]
    return unsigned, scales, scales.half().float() * -32  # the min of the rounded scale: exact


_K_READERS = {GGML_Q4_K: _read_q4_k, GGML_Q5_K: _read_q5_k, GGML_Q6_K: _read_q6_k}


@dataclass(frozen=True)
class StackedWeight:
    """A fused layer whose row blocks are stored in different types (a Q4_K_M file's q and k
    in Q4_K, v in Q6_K): each block multiplies on its own and the outputs are concatenated.
    A block of a type the kernels do not read is a float tensor [rows, in_features]."""

    parts: tuple[QuantizedWeight | PackedWeight | torch.Tensor, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.shape[0] for part in self.parts), self.parts[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(
            p.nbytes if isinstance(p, QuantizedWeight | PackedWeight) else p.numel() * p.element_size()
            for p in self.parts
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [p.matmul(x) if isinstance(p, QuantizedWeight | PackedWeight) else F.linear(x, p) for p in self.parts]
        return torch.cat(outputs, dim=-1)


def quantized_linear_torch(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x @ W.T with W dequantized to float32: the operator's oracle and fallback."""
    return F.linear(x.float(), weight.dequantize()).to(x.dtype)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """x @ W.T: on CUDA the Triton kernel (kernels/quantized_matmul.py); on a CPU the
    compiled operator, else the float32 reference. x: [rows, in_features] float32 or
    bfloat16. On a CPU every number of rows takes the same int8 kernel, so a row's output
    does not depend on the others (the layers pack their weights once: `for_this_device`)."""
    if x.device.type == "cuda":
        from pagefleet.kernels.quantized_matmul import quantized_matmul

        assert not weight.planes, "the planes layout is the CPU kernel's: a CUDA weight stays as loaded"
        return quantized_matmul(x.contiguous(), weight.quants, weight.scales, weight.mins, weight.format == FOUR_BIT)
    if x.device.type != "cpu" or not cpu_ops.has_quantized_linear():
        return quantized_linear_torch(x, weight)
    if cpu_ops.quantized_packed_layout():
        return PackedWeight.pack(weight).matmul(x)
    return torch.ops.pagefleet.quantized_linear(
        x.contiguous(), weight.quants, weight.scales, weight.mins, weight.format
    )


# The packed kernel's kinds (`kind` in cpu_quant.cpp): how each format's codes multiply.
_PACKED_KINDS = {
    GGML_Q4_0: 0,
    GGML_Q4_1: 0,
    GGML_Q4_K: 0,
    GGML_Q5_0: 1,
    GGML_Q5_1: 1,
    GGML_Q5_K: 1,
    GGML_Q6_K: 2,
    GGML_Q8_0: 3,
}
SIGNED_KIND = 3  # Q8_0, stored signed: a byte a weight
# Each unsigned kind's codes are stored as their low nibbles, two a byte, then a plane of 32
# bytes per bit above the fourth: bit k of a plane's byte is the bit of step k's weight.
_HIGH_BITS = {0: 0, 1: 1, 2: 2}
_STEP_BITS = torch.arange(8, dtype=torch.uint8).view(8, 1)
LANES = 8  # output columns interleaved in the packed layout


@dataclass(frozen=True)
class PackedWeight:
    """A `QuantizedWeight` repacked for the AVX2 kernel (kernels/csrc/cpu_quant_columns.h):
    output columns in groups of 8 (the last padded with zero columns), each block of 32
    weights stored as 8 steps of 4 weights of each of the 8 columns, so that a 256-bit lane
    holds one column. Q8_0's codes are stored signed (u - 128, min 0), a byte each; the
    others' as low nibbles and 1 (5-bit) or 2 (6-bit) planes of their high bits.

    quants: uint8 [groups, blocks * (128, 160, 192 or 256 for 4-, 5-, 6- and 8-bit)];
    scales, mins: float16 [groups, in_features / group, 8]; mins empty where the kernel
    derives them (Q6_K, Q8_0: `stores_mins`)."""

    ggml_type: int
    quants: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    out_features: int

    @property
    def kind(self) -> int:
        return _PACKED_KINDS[self.ggml_type]

    @property
    def group(self) -> int:
        return 16 if self.ggml_type == GGML_Q6_K else BLOCK

    @property
    def has_min(self) -> bool:
        """Whether the kernel adds the mins: packed Q8_0 is signed, its mins zero."""
        return self.ggml_type != GGML_Q8_0

    @property
    def stores_mins(self) -> bool:
        """Whether `mins` holds the mins. Q6_K's are -32 times its scales (the kernel derives
        them: a quarter less to read a weight, 1.0 -> 0.875 bytes) and packed Q8_0's are zero;
        for those two `mins` is empty."""
        return self.ggml_type not in (GGML_Q6_K, GGML_Q8_0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.scales.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.mins))

    @classmethod
    def pack(cls, weight: QuantizedWeight) -> PackedWeight:
        out, in_features = weight.shape
        groups, blocks = -(-out // LANES), in_features // BLOCK
        codes = _codes(weight)  # [out, in] uint8
        pad = groups * LANES - out
        scales, mins = weight.scales, weight.mins
        if weight.ggml_type == GGML_Q8_0:
            codes, mins = codes ^ 0x80, (mins.float() + 128 * scales.float()).half()
        if weight.ggml_type == GGML_Q6_K:
            assert torch.equal(mins.float(), scales.float() * -32), "Q6_K's mins are -32 times its scales"
        if pad:
            codes = F.pad(codes, (0, 0, 0, pad))
            scales, mins = F.pad(scales, (0, 0, 0, pad)), F.pad(mins, (0, 0, 0, pad))
        steps = codes.reshape(groups, LANES, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, 8, -1)
        kind = _PACKED_KINDS[weight.ggml_type]
        if kind != SIGNED_KIND:  # [j, b, k, 4c + i]: the low nibbles two a byte, then the high bits' planes
            low = steps & 0x0F
            planes = [
                (((steps >> (4 + h)) & 1) << _STEP_BITS).sum(dim=2, keepdim=True).to(torch.uint8)
                for h in range(_HIGH_BITS[kind])
            ]
            steps = torch.cat([low[:, :, :4] | (low[:, :, 4:] << 4), *planes], dim=2)
        return cls(
            weight.ggml_type,
            steps.reshape(groups, -1).contiguous(),
            scales.reshape(groups, LANES, -1).transpose(1, 2).contiguous(),
            mins.reshape(groups, LANES, -1).transpose(1, 2).contiguous()
            if weight.ggml_type not in (GGML_Q6_K, GGML_Q8_0)
            else torch.empty(0, dtype=torch.float16, device=scales.device),
            out,
        )

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out_features, in_features], or only `rows` of it (an embedding lookup)."""
        group_index = slice(None) if rows is None else rows // LANES
        quants, scales = self.quants[group_index], self.scales[group_index]
        if self.stores_mins:
            mins = self.mins[group_index]
        else:
            mins = scales.float() * (-32 if self.ggml_type == GGML_Q6_K else 0)
        groups = quants.shape[0]
        kind = self.kind
        steps = quants.reshape(groups, -1, 8 if kind == SIGNED_KIND else 4 + _HIGH_BITS[kind], LANES, 4)
        if kind != SIGNED_KIND:
            nibbles = steps[:, :, :4]
            codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)
            for h in range(_HIGH_BITS[kind]):
                plane = steps[:, :, 4 + h : 5 + h]
                codes = codes | (((plane >> _STEP_BITS.view(8, 1, 1)) & 1) << (4 + h))
        else:
            codes = steps.view(torch.int8)
        codes = codes.permute(0, 3, 1, 2, 4).reshape(groups, LANES, -1, self.group)  # [j, c, groups, group]
        values = codes.float() * scales.transpose(1, 2).float().unsqueeze(-1) + mins.transpose(1, 2).float().unsqueeze(
            -1
        )
        values = values.reshape(groups, LANES, -1)
        if rows is None:
            return values.reshape(groups * LANES, -1)[: self.out_features]
        return values[torch.arange(len(rows)), rows % LANES]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return F.linear(x.float(), self.dequantize()).to(x.dtype)
        return torch.ops.pagefleet.quantized_linear_packed(
            x.contiguous(), self.quants, self.scales, self.mins, self.kind, self.out_features, self.has_min
        )


def _codes(weight: QuantizedWeight) -> torch.Tensor:
    """The unsigned code of every weight, uint8 [out_features, in_features] in element order."""
    if weight.format != FOUR_BIT and not weight.planes:
        return weight.quants  # a byte a code
    out, in_features = weight.shape
    codes = _nibbles(weight.quants[:, : in_features // 2].reshape(out, -1, BLOCK // 2), dim=2).reshape(out, -1)
    if weight.planes:
        planes = _PLANES[weight.ggml_type]
        per_byte = 8 // planes
        plane_bytes = weight.quants[:, in_features // 2 :].reshape(out, -1, 1, 64 // per_byte)
        shifts = (planes * torch.arange(per_byte, dtype=torch.uint8))[:, None]
        high = ((plane_bytes >> shifts) & ((1 << planes) - 1)).reshape(out, -1, 2, 2, 16).transpose(2, 3)
        codes = codes | (high.reshape(out, -1) << 4)
    return codes


def for_this_device(weight: QuantizedWeight | StackedWeight) -> QuantizedWeight | PackedWeight | StackedWeight:
    """The weight in the layout its device's kernel reads: packed where that is the AVX2
    kernel, 5- and 6-bit codes in planes where it is the VNNI one, else as it is."""
    if isinstance(weight, StackedWeight):
        return StackedWeight(tuple(_for_this_device(p) if isinstance(p, QuantizedWeight) else p for p in weight.parts))
    return _for_this_device(weight)


def _for_this_device(weight: QuantizedWeight) -> QuantizedWeight | PackedWeight:
    if weight.quants.device.type != "cpu" or not cpu_ops.has_quantized_linear():
        return weight
    if cpu_ops.quantized_packed_layout():
        return PackedWeight.pack(weight)
    return weight.with_planes() if weight.takes_planes else weight
