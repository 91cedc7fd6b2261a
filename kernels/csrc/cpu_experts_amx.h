// The fused-experts operator's bfloat16 matmul on CPUs with AMX (Sapphire Rapids and later):
// out[r][n] = x[r] . w[n] for the rows of one expert, by `tdpbf16ps` tiles.
//
// A tile product C[16 x 16] += A[16 x 32] . B[32 x 16] adds, for each element, the 32
// bfloat16 products (exact in float32) one after another in k order, each add rounded to
// float32: an element depends on its own row of A and column of B only. Here A is 16 weight
// rows read where they lie (no repacking of the weights) and B is 16 tokens' activations,
// transposed into pairs of k per token as `tdpbf16ps` reads them (padded with zero tokens),
// so out[r][n] is one chain over k in order whatever the other rows: batch invariant, as
// cpu_experts_gemm.h's chains are, with other bits than those (a CPU keeps one kernel for a
// layer's shape for every batch). vLLM's CPU backend runs its bfloat16 experts on AMX too;
// here a 2,048-token chunk's experts ran 6-8x faster than `vdpbf16ps` (docs/kernels.md).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_vec.h"

namespace pagefleet::experts_amx {

constexpr int64_t kTile = 16;   // rows of a tile, and float32 columns of C
constexpr int64_t kDepth = 32;  // bfloat16 values of k a tile product takes

// Whether the CPU has AMX's bfloat16 tiles and Linux lets this process use them (it must ask
// once: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)). PAGEFLEET_CPU_NO_AMX=1 keeps
// the AVX-512 kernel.
inline bool has_amx_bf16() {
  static const bool supported = [] {
    if (std::getenv("PAGEFLEET_CPU_NO_AMX") != nullptr) return false;
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool tiles = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;
    return tiles && bf16 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return supported;
}

// Whether a projection of `outputs` rows of `size` inputs fits the tiles (whole tiles both
// ways; every expert projection of the models served does).
inline bool fits(int64_t size, int64_t outputs) { return size % kDepth == 0 && outputs % (2 * kTile) == 0; }

// Whether bfloat16 weights [outputs, size] run on the tiles here, packed (multiply_packed):
// an AMX CPU, whole tiles, and this AVX-512 build (the packed runs' epilogues use it).
inline bool packed_fits(int64_t size, int64_t outputs) {
#if defined(__AVX512F__)
  return has_amx_bf16() && fits(size, outputs);
#else
  return false;
#endif
}

// The asm names the whole 64-byte configuration as its operand (GCC 12's _tile_loadconfig
// names 8 bytes, and the stores of the rest can be dropped); loads and stores clobber memory
// so that the packing before them and the reads after them stay in order.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
#define PAGEFLEET_TILE_LOAD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define PAGEFLEET_TILE_STORE(t, base, stride) \
  __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define PAGEFLEET_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define PAGEFLEET_TILE_DOT(c, a, b) __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// Eight tiles of 16 rows of 64 bytes: 0, 1 weights; 2, 3 tokens; 4-7 the sums.
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTile;
    config.bytes_per_row[t] = 64;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
}

// r[i] <- column i of the 16 x 16 32-bit values r held as rows.
__attribute__((target("avx512f"))) inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// Rows x[0 .. rows) as B tiles: per block of 16 tokens, per pair p of k, the 16 tokens'
// pairs side by side (a tile is 16 consecutive pairs: 1 KiB at stride 64), 16 pairs of 16
// tokens transposed at a time. Tokens past `rows` are zeros. packed: [ceil(rows / 16),
// size / 2, 16] 32-bit pairs.
__attribute__((target("avx512f"))) inline void pack_tokens(const c10::BFloat16* const* x, int64_t rows,
                                                            int64_t size, uint32_t* packed) {
  const int64_t pairs = size / 2;
  for (int64_t first = 0; first < rows; first += kTile) {
    const int64_t tokens = std::min(kTile, rows - first);
    uint32_t* block = packed + (first / kTile) * pairs * kTile;
    for (int64_t p = 0; p < pairs; p += kTile) {
      __m512i r[16];
      for (int64_t t = 0; t < kTile; ++t)
        r[t] = t < tokens ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(x[first + t]) + p)
                          : _mm512_setzero_si512();
      transpose16(r);
      for (int64_t i = 0; i < kTile; ++i) _mm512_storeu_si512(block + (p + i) * kTile, r[i]);
    }
  }
}

// The sums of a C tile (16 outputs by 16 tokens) into out[token][first_output ..] for the
// block's first `tokens` tokens.
__attribute__((target("avx512f"))) inline void scatter(const float* sums, int64_t tokens, int64_t first_output,
                                                        float* out, int64_t out_stride) {
  __m512i r[16];
  for (int64_t i = 0; i < kTile; ++i) r[i] = _mm512_load_si512(sums + i * kTile);
  transpose16(r);
  for (int64_t t = 0; t < tokens; ++t) _mm512_storeu_si512(out + t * out_stride + first_output, r[t]);
}

// out [rows, out_stride] float32 = x @ w.T for rows <= 64 (any), w bfloat16 [outputs, size]
// (`fits`), by blocks of 32 outputs and 32 tokens; packed: pack_tokens' buffer.
__attribute__((target("amx-tile,amx-bf16,avx512f"))) inline void linear_rows(const c10::BFloat16* const* x, int64_t rows,
                                                                     const c10::BFloat16* w, int64_t size,
                                                                     int64_t outputs, float* out, int64_t out_stride,
                                                                     uint32_t* packed) {
  pack_tokens(x, rows, size, packed);
  configure_tiles();
  const int64_t pairs = size / 2, row_bytes = size * 2;
  alignas(64) float sums[4][kTile * kTile];
  for (int64_t first = 0; first < rows; first += 2 * kTile) {
    const int64_t tokens = std::min<int64_t>(2 * kTile, rows - first);
    const uint32_t* block0 = packed + (first / kTile) * pairs * kTile;
    const uint32_t* block1 = block0 + pairs * kTile;  // read only when tokens > 16
    for (int64_t n = 0; n < outputs; n += 2 * kTile) {
      const c10::BFloat16* w0 = w + n * size;
      const c10::BFloat16* w1 = w0 + kTile * size;
      PAGEFLEET_TILE_ZERO(4);
      PAGEFLEET_TILE_ZERO(5);
      PAGEFLEET_TILE_ZERO(6);
      PAGEFLEET_TILE_ZERO(7);
      for (int64_t k = 0; k < size; k += kDepth) {
        PAGEFLEET_TILE_LOAD(0, w0 + k, row_bytes);
        PAGEFLEET_TILE_LOAD(1, w1 + k, row_bytes);
        PAGEFLEET_TILE_LOAD(2, block0 + k / 2 * kTile, 64);
        PAGEFLEET_TILE_DOT(4, 0, 2);
        PAGEFLEET_TILE_DOT(6, 1, 2);
        if (tokens > kTile) {
          PAGEFLEET_TILE_LOAD(3, block1 + k / 2 * kTile, 64);
          PAGEFLEET_TILE_DOT(5, 0, 3);
          PAGEFLEET_TILE_DOT(7, 1, 3);
        }
      }
      PAGEFLEET_TILE_STORE(4, sums[0], 64);
      PAGEFLEET_TILE_STORE(6, sums[2], 64);
      scatter(sums[0], std::min(tokens, kTile), n, out + first * out_stride, out_stride);
      scatter(sums[2], std::min(tokens, kTile), n + kTile, out + first * out_stride, out_stride);
      if (tokens > kTile) {
        PAGEFLEET_TILE_STORE(5, sums[1], 64);
        PAGEFLEET_TILE_STORE(7, sums[3], 64);
        scatter(sums[1], tokens - kTile, n, out + (first + kTile) * out_stride, out_stride);
        scatter(sums[3], tokens - kTile, n + kTile, out + (first + kTile) * out_stride, out_stride);
      }
    }
  }
  __asm__ volatile("tilerelease" ::);
}

// Weights packed once at load for the tiles' other operand (kernels/amx_tiles.py
// `pack_for_tiles`): each 16 outputs by 32 inputs as 16 pairs of inputs by 16 outputs, 1 KiB
// a tile, a block of 16 outputs' tiles in k order. Tokens are then the first operand as
// their rows lie, and each C tile is 16 tokens by 16 outputs, stored row by row: no
// transposes either side (with cpu_experts_packed.h's phases, a 2,048-token chunk's experts
// went 30 -> 22 ms here). The products and their order over k are linear_rows': the same bits.
//   packed[n / 16][k / 32][(k % 32) / 2][n % 16][k % 2] = w[n][k]
//
// The sums of up to 32 tokens (rows x0 .. x0 + tokens, `size` values apart) by the 16-output
// packed blocks w0 and w1, into staging [32 tokens][32]: w0's outputs, then w1's.
__attribute__((target("amx-tile,amx-bf16"))) inline void block_sums_packed(const c10::BFloat16* x0, int64_t tokens,
                                                                           int64_t size, const c10::BFloat16* w0,
                                                                           const c10::BFloat16* w1, float* staging) {
  const int64_t x_bytes = size * 2, staging_bytes = 2 * kTile * 4;
  const c10::BFloat16* x1 = x0 + kTile * size;  // read only when tokens > 16
  PAGEFLEET_TILE_ZERO(4);
  PAGEFLEET_TILE_ZERO(5);
  PAGEFLEET_TILE_ZERO(6);
  PAGEFLEET_TILE_ZERO(7);
  for (int64_t k = 0; k < size; k += kDepth, w0 += kTile * kDepth, w1 += kTile * kDepth) {
    PAGEFLEET_TILE_LOAD(0, x0 + k, x_bytes);
    PAGEFLEET_TILE_LOAD(2, w0, 64);
    PAGEFLEET_TILE_LOAD(3, w1, 64);
    PAGEFLEET_TILE_DOT(4, 0, 2);
    PAGEFLEET_TILE_DOT(5, 0, 3);
    if (tokens > kTile) {
      PAGEFLEET_TILE_LOAD(1, x1 + k, x_bytes);
      PAGEFLEET_TILE_DOT(6, 1, 2);
      PAGEFLEET_TILE_DOT(7, 1, 3);
    }
  }
  PAGEFLEET_TILE_STORE(4, staging, staging_bytes);
  PAGEFLEET_TILE_STORE(5, staging + kTile, staging_bytes);
  if (tokens > kTile) {
    PAGEFLEET_TILE_STORE(6, staging + 2 * kTile * kTile, staging_bytes);
    PAGEFLEET_TILE_STORE(7, staging + 2 * kTile * kTile + kTile, staging_bytes);
  }
}

// x @ w.T for x bfloat16 [rows, size] (rows contiguous, and readable up to a multiple of 16:
// tiles load 16) and w packed (`fits`), block by block: for each 32 tokens from `first` and
// each j in [j0, j1), the sums of w's 16-output blocks j * step and j * step + second into
// staging (block_sums_packed), then epilogue(first, tokens, j, staging) for the block's
// tokens. The epilogue takes the sums while they are in L1: an activation over gate and up
// blocks side by side (step 1, second I / 16), a finished down row (step 2, second 1), so no
// whole-row float buffers. Blocks of tokens outer, each over weights that stay in L2 (an
// expert's), or with `rows_inner` blocks of outputs outer, each read from memory once for
// every row (the vocabulary head's 311 MB at 64 rows: 19.3 -> 17.7 ms).
template <typename Epilogue>
__attribute__((target("amx-tile,amx-bf16"))) void multiply_packed(const c10::BFloat16* x, int64_t rows, int64_t size,
                                                                  const c10::BFloat16* w, int64_t j0, int64_t j1,
                                                                  int64_t step, int64_t second, float* staging,
                                                                  const Epilogue& epilogue, bool rows_inner = false) {
  configure_tiles();
  const int64_t block = size * kTile;  // values of a 16-output block
  const auto run = [&](int64_t first, int64_t j) {
    const c10::BFloat16* w0 = w + j * step * block;
    const int64_t tokens = std::min(2 * kTile, rows - first);
    block_sums_packed(x + first * size, tokens, size, w0, w0 + second * block, staging);
    epilogue(first, tokens, j, static_cast<const float*>(staging));
  };
  if (rows_inner) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t first = 0; first < rows; first += 2 * kTile) run(first, j);
  } else {
    for (int64_t first = 0; first < rows; first += 2 * kTile)
      for (int64_t j = j0; j < j1; ++j) run(first, j);
  }
  __asm__ volatile("tilerelease" ::);
}

#undef PAGEFLEET_TILE_LOAD
#undef PAGEFLEET_TILE_STORE
#undef PAGEFLEET_TILE_ZERO
#undef PAGEFLEET_TILE_DOT

}  // namespace pagefleet::experts_amx
