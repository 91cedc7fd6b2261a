// The fused-experts operator's matmul: out[r][n] = x[r] . w[n] (a linear layer without bias)
// for a few rows of one expert, with one arithmetic per (row, output) whatever the rows
// computed beside it.
//
// Path invariance is the point: a token's expert output must not change with how many
// tokens the expert received in this batch. oneDNN and MKL pick kernels, blockings and
// K-splits by the number of rows, so `at::mm` gives no such promise. Here every (row,
// output) pair is one chain of 16-lane FMAs over k in order, then one fixed tree:
//
//   lanes v[0..15] -> s[i] = (v[i] + v[i+8]) + (v[i+4] + v[i+12]), i < 4
//                  -> (s[0] + s[2]) + (s[1] + s[3])
//
// Tiles of 1..4 rows x 4 outputs share each load of x and of w; the tile's shape changes
// which loads are shared, never the arithmetic of a pair (tests/kernels/test_fused_experts.py
// checks a token alone against the same token among 99 others).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu_vec.h"

namespace pagefleet::experts {

constexpr int kTileRows = 4;
constexpr int kTileColumns = 4;

#if defined(__AVX512F__)
inline __m512 load16_masked(const float* source, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, source); }
inline __m512 load16_masked(const c10::BFloat16* source, __mmask16 mask) {
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, source);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// The four sums of a, b, c, d, each by the tree above (the same for all four: lane j of a
// 128-bit quarter meets the same partners in every quarter).
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  // Quarter q now holds vector q's s[i] before the last add: (v[i] + v[i+8]) and (v[i+4] + v[i+12]).
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(1, 0, 3, 2)));  // s[i] + s[i^2]
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(2, 3, 0, 1)));  // + its neighbour: a commutative pair
  const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, s));
}

// rows x 4 outputs: out[r][j] = x[r] . w[j], j < columns (w[j] for j >= columns repeats a
// valid row; its sums are dropped). `ahead` (or null): weight rows of a later tile, fetched
// into L2 beside w's own loads (a layer's 64-sequence decode step reads every expert's rows
// once: 11.4 -> 8.8-9.4 ms a layer here, the hardware prefetcher alone following four
// 4 KiB rows badly).
template <int kRows, typename T>
void tile(const float* const* x, const T* const* w, int64_t size, float* out, int64_t out_stride, int columns,
          const T* const* ahead) {
  __m512 acc[kRows][kTileColumns];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kTileColumns; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= size; k += 16) {
    __m512 weights[kTileColumns];
    for (int j = 0; j < kTileColumns; ++j) {
      weights[j] = load16(w[j] + k);
      if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead[j] + k), _MM_HINT_T1);
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512 row = _mm512_loadu_ps(x[r] + k);
      for (int j = 0; j < kTileColumns; ++j) acc[r][j] = _mm512_fmadd_ps(row, weights[j], acc[r][j]);
    }
  }
  if (k < size) {  // the same masked step for every row: zeros add nothing
    const __mmask16 mask = static_cast<__mmask16>((1u << (size - k)) - 1);
    __m512 weights[kTileColumns];
    for (int j = 0; j < kTileColumns; ++j) weights[j] = load16_masked(w[j] + k, mask);
    for (int r = 0; r < kRows; ++r) {
      const __m512 row = _mm512_maskz_loadu_ps(mask, x[r] + k);
      for (int j = 0; j < kTileColumns; ++j) acc[r][j] = _mm512_fmadd_ps(row, weights[j], acc[r][j]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    alignas(16) float sums[4];
    _mm_store_ps(sums, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    std::copy(sums, sums + columns, out + r * out_stride);
  }
}

// bfloat16 rows against bfloat16 weights on CPUs with AVX512_BF16 (`has_bf16_dot()`):
// `vdpbf16ps` adds two products a lane per step (the pairs of k), twice the multiply-adds
// of widening to float32, as oneDNN's bfloat16 matmul runs here. Still one chain per (row,
// output) and the tree above; its bits differ from the float32 chain's, so a CPU keeps one
// or the other for every batch.
template <int kRows>
__attribute__((target("avx512bf16"))) void tile(const c10::BFloat16* const* x, const c10::BFloat16* const* w,
                                                 int64_t size, float* out, int64_t out_stride, int columns,
                                                 const c10::BFloat16* const* ahead) {
  __m512 acc[kRows][kTileColumns];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kTileColumns; ++j) acc[r][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= size; k += 32) {
    __m512bh weights[kTileColumns];
    for (int j = 0; j < kTileColumns; ++j) {
      weights[j] = (__m512bh)_mm512_loadu_si512(w[j] + k);
      if (ahead != nullptr) _mm_prefetch(reinterpret_cast<const char*>(ahead[j] + k), _MM_HINT_T1);
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512bh row = (__m512bh)_mm512_loadu_si512(x[r] + k);
      for (int j = 0; j < kTileColumns; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], row, weights[j]);
    }
  }
  if (k < size) {  // the same masked step for every row: zero pairs add nothing
    const __mmask32 mask = static_cast<__mmask32>((1u << (size - k)) - 1);
    __m512bh weights[kTileColumns];
    for (int j = 0; j < kTileColumns; ++j) weights[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[j] + k);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh row = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[r] + k);
      for (int j = 0; j < kTileColumns; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], row, weights[j]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    alignas(16) float sums[4];
    _mm_store_ps(sums, sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    std::copy(sums, sums + columns, out + r * out_stride);
  }
}

inline bool has_bf16_dot() {
  static const bool supported = __builtin_cpu_supports("avx512bf16");
  return supported;
}
#else
inline bool has_bf16_dot() { return false; }

// Without AVX-512: the same shape of sum in plain C++ (16 partial sums, the same tree).
template <typename T>
float dot(const float* x, const T* w, int64_t size) {
  float lanes[16] = {};
  int64_t k = 0;
  for (; k + 16 <= size; k += 16)
    for (int i = 0; i < 16; ++i) lanes[i] += x[k + i] * widen(w[k + i]);
  for (int i = 0; k + i < size; ++i) lanes[i] += x[k + i] * widen(w[k + i]);
  float s[4];
  for (int i = 0; i < 4; ++i) s[i] = (lanes[i] + lanes[i + 8]) + (lanes[i + 4] + lanes[i + 12]);
  return (s[0] + s[2]) + (s[1] + s[3]);
}

template <int kRows, typename T>
void tile(const float* const* x, const T* const* w, int64_t size, float* out, int64_t out_stride, int columns,
          const T* const*) {
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < columns; ++j) out[r * out_stride + j] = dot(x[r], w[j], size);
}
#endif

// out[r][n] = x[r] . w[n] for r < rows, n < outputs; w: [outputs, size] rows of T, x: rows
// of float32, or of bfloat16 where has_bf16_dot() (pointers, so that rows are read where
// they are), out: float32
// [rows, out_stride]. Outputs outer, rows inner: a tile's 4 weight rows stay in L1 while
// every row passes.
template <typename X, typename T>
void linear_rows(const X* const* x, int64_t rows, const T* w, int64_t size, int64_t outputs, float* out,
                 int64_t out_stride) {
  for (int64_t n = 0; n < outputs; n += kTileColumns) {
    const int columns = static_cast<int>(std::min<int64_t>(kTileColumns, outputs - n));
    const T* w_rows[kTileColumns];
    const T* next_rows[kTileColumns];  // the rows 8 tiles on, prefetched by this tile's first rows
    for (int j = 0; j < kTileColumns; ++j) {
      w_rows[j] = w + (n + std::min(j, columns - 1)) * size;
      next_rows[j] = w + std::min(n + 8 * kTileColumns + j, outputs - 1) * size;
    }
    const T* const* ahead = next_rows;
    int64_t r = 0;
    for (; r + kTileRows <= rows; r += kTileRows, ahead = nullptr)
      tile<kTileRows>(x + r, w_rows, size, out + r * out_stride + n, out_stride, columns, ahead);
    switch (rows - r) {
      case 3:
        tile<3>(x + r, w_rows, size, out + r * out_stride + n, out_stride, columns, ahead);
        break;
      case 2:
        tile<2>(x + r, w_rows, size, out + r * out_stride + n, out_stride, columns, ahead);
        break;
      case 1:
        tile<1>(x + r, w_rows, size, out + r * out_stride + n, out_stride, columns, ahead);
        break;
      default:
        break;
    }
  }
}

}  // namespace pagefleet::experts
