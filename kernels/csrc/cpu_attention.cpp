// Paged decode attention for CPUs: one query token per sequence over its whole context,
// read in place from the paged KV cache through the sequence's block table (no gather).
//
// Work is split into items of (sequence, kv head, partition of at most kPartition tokens).
// An item computes all query heads that share its kv head together (grouped-query
// attention: the keys and values are read once for the whole group), and keeps a float32
// softmax that is exact within its partition: its maximum, its sum of exponentials and its
// unnormalised output. A second pass combines the partitions of each (sequence, kv head).
// Items run on torch's intra-op thread pool, so long contexts spread over every thread.
//
//   cache (any strides, head_dim contiguous):   [num_blocks, block_size, num_kv_heads, D]
//   token t of a sequence lives at block table[t / block_size], offset t % block_size
//
// Built at run time by pagefleet/kernels/cpu_ops.py for the best instruction set the
// CPU has (AVX-512 with BF16, AVX2 or none); the loops below are written for the compiler
// to vectorise (`omp simd`) and bf16 is widened to float by a shift, which vectorises too.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_paged.h"
#include "cpu_vec.h"

namespace {

using namespace pagefleet;

constexpr int64_t kPartition = 256;  // tokens per work item
constexpr int64_t kRowBlock = 16;    // query rows of one sequence sharing each key read
constexpr int64_t kBlockHeads = 16;  // fewest query heads (rows x group) that score_block takes
#if defined(__AVX512F__)
constexpr bool kAvx512 = true;  // head sizes 64, 128 and 256 take the AVX-512 kernels below
#else
constexpr bool kAvx512 = false;
#endif

// The head sizes the AVX-512 register kernels take (16 * C dims, C known at compile time).
inline bool register_head(int64_t head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

// run(std::integral_constant<int, C>) for a head size `register_head` takes.
template <typename Run>
void by_head_size(int64_t head_dim, const Run& run) {
  if (head_dim == 64) run(std::integral_constant<int, 4>{});
  else if (head_dim == 128) run(std::integral_constant<int, 8>{});
  else run(std::integral_constant<int, 16>{});
}

template <typename T>
inline void load_row(const T* source, float* row, int64_t head_dim) {
#pragma omp simd
  for (int64_t d = 0; d < head_dim; ++d) row[d] = widen(source[d]);
}

using Geometry = PagedGeometry;

// scores <- exp(scores - max); writes the max and the sum of the exponentials.
inline void softmax_unnormalised(float* scores, int64_t count, float* max_out, float* sum_out) {
  float maximum = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 maxima = _mm512_set1_ps(maximum);
  for (; i + 16 <= count; i += 16) maxima = _mm512_max_ps(maxima, _mm512_loadu_ps(scores + i));
  maximum = _mm512_reduce_max_ps(maxima);
#endif
  for (; i < count; ++i) maximum = std::max(maximum, scores[i]);
  float sum = 0.f;
  i = 0;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(maximum);
  __m512 total = _mm512_setzero_ps();
  for (; i + 16 <= count; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + i), shift));
    _mm512_storeu_ps(scores + i, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#endif
  for (; i < count; ++i) {
    scores[i] = std::exp(scores[i] - maximum);
    sum += scores[i];
  }
  *max_out = maximum;
  *sum_out = sum;
}

// scores <- softcap * tanh(scores / softcap): Gemma 2's attn_logit_softcapping, which keeps
// any logit from dominating its softmax. Called only when softcap > 0, so that without a cap
// the arithmetic (and every bit of the output) is what it was.
inline void soft_cap(float* scores, int64_t count, float softcap) {
  for (int64_t i = 0; i < count; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
}

#if defined(__AVX512F__)
// v[k] holds 16 partial sums of key k's dot product; returns the 16 totals in key order.
// A tree of shuffles that reduces all 16 at once costs a third of 16 separate horizontal
// reductions, which were most of the work of scoring.
inline __m512 sum_each16(const __m512* v) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int i = 0; i < 8; ++i) {  // [key 2i: 8 partials, key 2i+1: 8 partials]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane l: key 4i + l, 4 partials
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // lane l: keys 8i + l and 8i + 4 + l, 2 partials each
    const __m512d a = _mm512_castps_pd(quarters[2 * i]), b = _mm512_castps_pd(quarters[2 * i + 1]);
    eighths[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lane l: keys l, 4 + l, 8 + l, 12 + l
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// The partition's scores and weighted values with head_dim = 16 * C known at compile time,
// so that a row lives in C registers. Each key or value row is loaded (and widened) once
// for all the query heads of the group, `H` heads at a time. rows: `count` rows of C * 16;
// q: [group, C * 16] float32; scores: [group, count]; acc: [group, C * 16].
// Rows are read where they lie in the cache; the blocks are scattered, so the hardware
// prefetcher cannot guess the next one: each row is asked for kAhead rows before its use.
constexpr int64_t kAhead = 16;

template <int C, typename T, int kLocality = 3>
inline void prefetch_row(const T* row) {
  constexpr int kBytes = C * 16 * static_cast<int>(sizeof(T));
  for (int byte = 0; byte < kBytes; byte += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + byte, 0, kLocality);
}

// value_offset (bytes from a key row to its value row), when not 0: the value rows are
// asked for too, into L2, so that both streams are in flight during the scoring.
// Up to head size 128 the queries stay in registers; at 256 (Gemma 3) a key row alone fills
// half of them, and the queries are read from L1 instead (the same arithmetic either way).
template <int C, int H, typename T>
void score_heads(const float* q, const T* const* rows, int64_t count, int64_t count_stride, float* scores,
                 std::ptrdiff_t value_offset) {
  constexpr bool kHeld = C <= 8;
  __m512 qh[kHeld ? H : 1][kHeld ? C : 1];
  if constexpr (kHeld) {
    for (int h = 0; h < H; ++h) {
      for (int c = 0; c < C; ++c) qh[h][c] = _mm512_loadu_ps(q + h * C * 16 + c * 16);
    }
  }
  const auto query = [&](int h, int c) {
    if constexpr (kHeld) return qh[h][c];
    else return _mm512_loadu_ps(q + h * C * 16 + c * 16);
  };
  alignas(64) __m512 dots[H][16];
  int64_t t = 0;
  for (; t + 16 <= count; t += 16) {
    for (int k = 0; k < 16; ++k) {
      const T* ahead = rows[std::min(t + k + kAhead, count - 1)];
      prefetch_row<C>(ahead);
      if (value_offset != 0) {
        prefetch_row<C, T, 2>(reinterpret_cast<const T*>(reinterpret_cast<std::intptr_t>(ahead) + value_offset));
      }
      const T* row = rows[t + k];
      __m512 r[C];
      for (int c = 0; c < C; ++c) r[c] = load16(row + c * 16);
      for (int h = 0; h < H; ++h) {
        __m512 dot = _mm512_mul_ps(query(h, 0), r[0]);
        for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(query(h, c), r[c], dot);
        dots[h][k] = dot;
      }
    }
    for (int h = 0; h < H; ++h) _mm512_storeu_ps(scores + h * count_stride + t, sum_each16(dots[h]));
  }
  for (; t < count; ++t) {
    const T* row = rows[t];
    for (int h = 0; h < H; ++h) {
      __m512 dot = _mm512_mul_ps(query(h, 0), load16(row));
      for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(query(h, c), load16(row + c * 16), dot);
      scores[h * count_stride + t] = _mm512_reduce_add_ps(dot);
    }
  }
}

// 64 dimensions of a row as four float vectors. float: vector i holds dims 16i + lane.
// bfloat16: two 64-byte loads, each split by a shift and a mask (no shuffle) into its even
// and its odd dimensions: vector 2i holds dims 32i + 2 lane, vector 2i + 1 dims 32i + 2 lane + 1.
inline void load64(const float* row, __m512* r) {
  for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_ps(row + 16 * i);
}
inline void load64(const c10::BFloat16* row, __m512* r) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int i = 0; i < 2; ++i) {
    const __m512i raw = _mm512_loadu_si512(row + 32 * i);
    r[2 * i] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    r[2 * i + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
  }
}
// Stores four vectors that load64<T> laid out, each value at its own dimension.
inline void store64(float* out, const __m512* r, const float*) {
  for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + 16 * i, r[i]);
}
inline void store64(float* out, const __m512* r, const c10::BFloat16*) {
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int i = 0; i < 2; ++i) {
    _mm512_storeu_ps(out + 32 * i, _mm512_permutex2var_ps(r[2 * i], low, r[2 * i + 1]));
    _mm512_storeu_ps(out + 32 * i + 16, _mm512_permutex2var_ps(r[2 * i], high, r[2 * i + 1]));
  }
}

// acc[h * C * 16 + d] = the weighted sum of the rows' dimension d, in key order, for H heads:
// 64 dimensions a pass, so that every head's sums (4 registers each) stay in registers while
// a row's 64 values are loaded once for all of them. Each output is the same chain of FMAs
// over the keys whatever the pass layout; only which values share a load changes.
template <int C, int H, typename T>
void accumulate_heads(const float* weights, const T* const* rows, int64_t count, int64_t count_stride, float* acc) {
  for (int c0 = 0; c0 < C * 16; c0 += 64) {
    __m512 sum[H][4];
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < 4; ++i) sum[h][i] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < count; ++t) {
      const T* ahead = rows[std::min(t + kAhead, count - 1)] + c0;
      for (int byte = 0; byte < 64 * static_cast<int>(sizeof(T)); byte += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(ahead) + byte, 0, 3);
      __m512 r[4];
      load64(rows[t] + c0, r);
      for (int h = 0; h < H; ++h) {
        const __m512 weight = _mm512_set1_ps(weights[h * count_stride + t]);
        for (int i = 0; i < 4; ++i) sum[h][i] = _mm512_fmadd_ps(weight, r[i], sum[h][i]);
      }
    }
    for (int h = 0; h < H; ++h) store64(acc + h * C * 16 + c0, sum[h], static_cast<const T*>(nullptr));
  }
}

// The group's heads in chunks of kHeads whose accumulators stay in registers, and the rest
// as one chunk (a group of 3, as SmolLM2's, is one pass over the rows, not three). Only the
// first chunk asks for the value rows.
template <int kHeads, typename Run>
void by_head_chunks(int64_t group, const Run& run) {
  for (int64_t h = 0; h < group;) {
    const int64_t heads = std::min<int64_t>(kHeads, group - h);
    if (heads == 4) run(h, std::integral_constant<int, 4>{});
    if (heads == 3) run(h, std::integral_constant<int, 3>{});
    if (heads == 2) run(h, std::integral_constant<int, 2>{});
    if (heads == 1) run(h, std::integral_constant<int, 1>{});
    h += heads;
  }
}

// Scoring: 4 heads a pass (2 at head size 128, whose queries fill the registers).
template <int C, typename T>
void score_rows(const float* q, const T* const* rows, int64_t count, int64_t group, float* scores,
                std::ptrdiff_t value_offset) {
  by_head_chunks<C == 8 ? 2 : 4>(group, [&](int64_t h, auto heads) {
    score_heads<C, decltype(heads)::value>(q + h * C * 16, rows, count, count, scores + h * count,
                                           h == 0 ? value_offset : 0);
  });
}

// Accumulating: 4 heads a pass over 64 dimensions at a time.
template <int C, typename T>
void accumulate_rows(const float* weights, const T* const* rows, int64_t count, int64_t group, float* acc) {
  by_head_chunks<4>(group, [&](int64_t h, auto heads) {
    accumulate_heads<C, decltype(heads)::value>(weights + h * count, rows, count, count, acc + h * C * 16);
  });
}

// The rows of a prompt's block read the same keys. Scored together, each tile of 16 keys is
// transposed once (a vector per dimension, a lane per key) for all the block's rows and heads,
// and a head's 16 scores are lanes of broadcast FMAs: no reduction shuffles, no widening per
// row. Lane k computes key k's score with the operations score_heads does: the same FMA chain
// for each of its 16 partial sums, then the tree sum_each16 (and _mm512_reduce_add_ps, for the
// last keys) adds them in. A row's scores are the bits it gets alone.

// f(std::integral_constant<int, i>{}) for each i of the sequence, in order.
template <typename F, int... i>
inline void unrolled(std::integer_sequence<int, i...>, const F& f) {
  (f(std::integral_constant<int, i>{}), ...);
}

// r[k] = 16 words of row k -> r[w] = word w of the 16 rows.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // 128-bit lane l: words 4l, 4l + 1 (lo) or 4l + 2, 4l + 3 (hi)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // t'[i + j], lane l: word 4l + j of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // lanes l of rows 0-3, 4-7, 8-11, 12-15: words j, 4 + j, 8 + j, 12 + j
    const __m512i even_low = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x88);
    const __m512i odd_low = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xDD);
    const __m512i even_high = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x88);
    const __m512i odd_high = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xDD);
    t[j] = _mm512_shuffle_i32x4(even_low, even_high, 0x88);
    t[8 + j] = _mm512_shuffle_i32x4(even_low, even_high, 0xDD);
    t[4 + j] = _mm512_shuffle_i32x4(odd_low, odd_high, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(odd_low, odd_high, 0xDD);
  }
  for (int w = 0; w < 16; ++w) r[w] = t[w];
}

// keys[d * 16 + k] = dimension d of rows[k], as float, for the 16 * C dimensions.
template <int C>
void transpose_keys(const float* const* rows, float* keys) {
  for (int d0 = 0; d0 < C * 16; d0 += 16) {
    __m512i r[16];
    for (int k = 0; k < 16; ++k) r[k] = _mm512_castps_si512(_mm512_loadu_ps(rows[k] + d0));
    transpose16(r);
    for (int d = 0; d < 16; ++d) _mm512_store_ps(keys + (d0 + d) * 16, _mm512_castsi512_ps(r[d]));
  }
}
// bfloat16: a word holds dimensions 2w and 2w + 1, widened after the transpose by a shift and a mask.
template <int C>
void transpose_keys(const c10::BFloat16* const* rows, float* keys) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int w0 = 0; w0 < C * 8; w0 += 16) {
    __m512i r[16];
    for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_si512(rows[k] + 2 * w0);
    transpose16(r);
    for (int w = 0; w < 16; ++w) {
      _mm512_store_ps(keys + 2 * (w0 + w) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(r[w], 16)));
      _mm512_store_ps(keys + (2 * (w0 + w) + 1) * 16, _mm512_castsi512_ps(_mm512_and_si512(r[w], high)));
    }
  }
}

// The scores of `heads` heads (q: [heads, C * 16]) for a transposed tile of keys: scores[h *
// stride + k] for its first `valid` keys. Partial sum l of a head's dot products (dimensions
// 16c + l) pairs with partial l + 8 as sum_each16's first step does; a pass takes the pairs
// whose keys fill 16 registers (l and l + 4 at C = 4, whose sums are its second step), and
// leaves their sums in `sums` ([heads, 8, 16]) for the rest of the tree.
template <int C>
void score_tile(const float* keys, const float* q, int64_t heads, float* sums, float* scores, int64_t stride,
                int64_t valid) {
  constexpr int kSpan = 8 / C;  // pairs of partial sums a pass
  unrolled(std::make_integer_sequence<int, 8 / kSpan>{}, [&](auto pass) {
    constexpr int l0 = decltype(pass)::value;  // known, so that the queries' offsets are constants
    __m512 k[kSpan][2][C];
    for (int s = 0; s < kSpan; ++s) {
      for (int c = 0; c < C; ++c) {
        k[s][0][c] = _mm512_load_ps(keys + (c * 16 + l0 + 4 * s) * 16);
        k[s][1][c] = _mm512_load_ps(keys + (c * 16 + l0 + 4 * s + 8) * 16);
      }
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + h * C * 16;
      __m512 pair[kSpan];
      for (int s = 0; s < kSpan; ++s) {
        __m512 dot[2];
        for (int i = 0; i < 2; ++i) {
          const int l = l0 + 4 * s + 8 * i;
          dot[i] = _mm512_mul_ps(_mm512_set1_ps(qh[l]), k[s][i][0]);
          for (int c = 1; c < C; ++c) dot[i] = _mm512_fmadd_ps(_mm512_set1_ps(qh[c * 16 + l]), k[s][i][c], dot[i]);
        }
        pair[s] = _mm512_add_ps(dot[0], dot[1]);
      }
      _mm512_storeu_ps(sums + (h * 8 + l0) * 16, kSpan == 2 ? _mm512_add_ps(pair[0], pair[1]) : pair[0]);
    }
  });
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int64_t h = 0; h < heads; ++h) {
    const float* s = sums + h * 8 * 16;
    __m512 quarter[4];
    for (int m = 0; m < 4; ++m) {
      quarter[m] = kSpan == 2 ? _mm512_loadu_ps(s + m * 16)
                              : _mm512_add_ps(_mm512_loadu_ps(s + m * 16), _mm512_loadu_ps(s + (m + 4) * 16));
    }
    const __m512 score = _mm512_add_ps(_mm512_add_ps(quarter[0], quarter[2]), _mm512_add_ps(quarter[1], quarter[3]));
    _mm512_mask_storeu_ps(scores + h * stride, mask, score);
  }
}

// Every row of the block over its keys, row r's scores laid out as score_rows lays them
// (at scores + r * group * kPartition, head j's at stride counts[r]). sums: group * 8 * 16.
// The next tile's key rows are asked for (and its value rows, into L2) as score_heads asks.
template <int C, typename T>
void score_block(const float* q, const T* const* rows, const int64_t* counts, int64_t n, int64_t group,
                 float* scores, float* sums, std::ptrdiff_t value_offset) {
  const int64_t longest = *std::max_element(counts, counts + n);
  alignas(64) float keys[C * 16 * 16];
  for (int64_t t0 = 0; t0 < longest; t0 += 16) {
    for (int64_t t = t0 + 16; t < std::min(t0 + 32, longest); ++t) {
      prefetch_row<C>(rows[t]);
      prefetch_row<C, T, 2>(reinterpret_cast<const T*>(reinterpret_cast<std::intptr_t>(rows[t]) + value_offset));
    }
    const T* tile[16];  // past the last key, the last key again (scored, never stored)
    for (int k = 0; k < 16; ++k) tile[k] = rows[std::min(t0 + k, longest - 1)];
    transpose_keys<C>(tile, keys);
    for (int64_t r = 0; r < n; ++r) {
      if (counts[r] <= t0) continue;
      score_tile<C>(keys, q + r * group * C * 16, group, sums, scores + r * group * kPartition + t0, counts[r],
                    std::min<int64_t>(16, counts[r] - t0));
    }
  }
}

// acc[h * C * 16 + d] for H heads, carried over keys [t0, t1) of a tile (rows[t - t0]: float
// value rows): the chain of FMAs accumulate_heads runs over the keys, in the same order.
template <int C, int H>
void accumulate_tile(const float* weights, int64_t stride, const float* const* rows, int64_t t0, int64_t t1,
                     float* acc) {
  for (int c0 = 0; c0 < C * 16; c0 += 64) {
    __m512 sum[H][4];
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < 4; ++i) {
        sum[h][i] = t0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + h * C * 16 + c0 + 16 * i);
      }
    }
    for (int64_t t = t0; t < t1; ++t) {
      __m512 r[4];
      for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_ps(rows[t - t0] + c0 + 16 * i);
      for (int h = 0; h < H; ++h) {
        const __m512 weight = _mm512_set1_ps(weights[h * stride + t]);
        for (int i = 0; i < 4; ++i) sum[h][i] = _mm512_fmadd_ps(weight, r[i], sum[h][i]);
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc + h * C * 16 + c0 + 16 * i, sum[h][i]);
    }
  }
}

// The block's weighted values (weights laid out as score_block leaves them) into each row's
// slot of `partial`, 16 KB of values a tile: a tile's value rows are widened once, into L1,
// for all the block's rows and heads, whose sums are carried from tile to tile in place.
template <int C, typename T>
void accumulate_block(const float* weights, const T* const* rows, const int64_t* counts, int64_t n, int64_t group,
                      const int64_t* slots, float* partial) {
  constexpr int64_t kTile = 256 / C;
  const int64_t longest = *std::max_element(counts, counts + n);
  alignas(64) float widened[std::is_same_v<T, float> ? 1 : kTile * C * 16];
  const float* tile[kTile];
  for (int64_t t0 = 0; t0 < longest; t0 += kTile) {
    const int64_t t1 = std::min(t0 + kTile, longest);
    for (int64_t t = t0; t < t1; ++t) {
      if (t + kTile < longest) prefetch_row<C>(rows[t + kTile]);
      if constexpr (std::is_same_v<T, float>) {
        tile[t - t0] = rows[t];
      } else {
        load_row(rows[t], widened + (t - t0) * C * 16, C * 16);
        tile[t - t0] = widened + (t - t0) * C * 16;
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      if (counts[r] <= t0) continue;
      const float* row_weights = weights + r * group * kPartition;
      by_head_chunks<4>(group, [&](int64_t h, auto heads) {
        accumulate_tile<C, decltype(heads)::value>(row_weights + h * counts[r], counts[r], tile, t0,
                                                   std::min(t1, counts[r]), partial + (slots[r] * group + h) * C * 16);
      });
    }
  }
}
#endif

// Any head size, the rows of a row block at once: scores[(r * group + j) * kPartition + t] =
// q_rj . key_t for the keys each row sees (t < counts[r]). Each key is widened once for
// every row; a (row, head, key)'s dot product is the same loop whatever the other rows.
template <typename T>
void score_rows_any(const float* q, const T* const* keys, const int64_t* counts, int64_t num_rows, int64_t group,
                    int64_t head_dim, float* buffer, float* scores) {
  const int64_t longest = *std::max_element(counts, counts + num_rows);
  for (int64_t t = 0; t < longest; ++t) {
    load_row(keys[t], buffer, head_dim);
    for (int64_t r = 0; r < num_rows; ++r) {
      if (t >= counts[r]) continue;
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = q + (r * group + j) * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qj[d] * buffer[d];
        scores[(r * group + j) * kPartition + t] = dot;
      }
    }
  }
}

// Any head size, every row of the block: acc[(r * group + j) * D + d] = sum over the keys
// row r sees of weights[(r * group + j) * kPartition + t] * value_t[d], in key order.
template <typename T>
void accumulate_rows_any(const float* weights, const T* const* values, const int64_t* counts, int64_t num_rows,
                         int64_t group, int64_t head_dim, float* buffer, float* acc) {
  const int64_t longest = *std::max_element(counts, counts + num_rows);
  std::fill(acc, acc + num_rows * group * head_dim, 0.f);
  for (int64_t t = 0; t < longest; ++t) {
    load_row(values[t], buffer, head_dim);
    for (int64_t r = 0; r < num_rows; ++r) {
      if (t >= counts[r]) continue;
      for (int64_t j = 0; j < group; ++j) {
        const float weight = weights[(r * group + j) * kPartition + t];
        float* out = acc + (r * group + j) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) out[d] += weight * buffer[d];
      }
    }
  }
}

#if defined(__AVX2__)
#include <immintrin.h>

#include "cpu_attention_avx2.h"
#endif

// Scratch of one thread, sized for a block of kRowBlock rows.
template <typename T>
struct Scratch {
  std::vector<float> scores, q, acc, buffer, widened;  // widened: bfloat16 rows as float
  std::vector<float> tile_sums;                        // score_block's partial sums
  std::vector<int64_t> rows, counts;
  std::vector<const T*> pointers;
  std::vector<const float*> float_rows;
  explicit Scratch(const Geometry& g)
      : scores(kRowBlock * g.group * kPartition),
        q(kRowBlock * g.group * g.head_dim),
        acc(kRowBlock * g.group * g.head_dim),
        buffer(g.head_dim),
        tile_sums(g.group * 8 * 16),
        rows(kPartition),
        counts(kRowBlock),
        pointers(kPartition),
        float_rows(kPartition) {
    if (!std::is_same_v<T, float>) widened.resize(kPartition * g.head_dim);
  }
};

// One item: query heads [kv_head * group, (kv_head + 1) * group) of rows [r0, r0 + n) of one
// sequence, over the partition of keys from `begin`: row r sees keys [begin, begin +
// counts[r]). Writes each row's partition max, sum and unnormalised output (float32) at
// slots[r] (a row's arithmetic is the same alone as in a block: decode rows are blocks of 1).
// softcap > 0 caps each scaled score before the softmax (0: no cap).
template <typename T>
void attend_partition(const T* query, const T* key_cache, const T* value_cache, const int32_t* table,
                      const Geometry& g, int64_t r0, int64_t n, int64_t kv_head, int64_t begin, float scale,
                      float softcap, Scratch<T>& s, const int64_t* slots, float* maxima, float* sums, float* partial) {
  const int64_t group = g.group, head_dim = g.head_dim, block_size = g.block_size;
  const int64_t* counts = s.counts.data();
  const int64_t longest = *std::max_element(counts, counts + n);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < group; ++j) {
      const T* source = query + (r0 + r) * g.query_stride_token + (kv_head * group + j) * g.query_stride_head;
      float* q = s.q.data() + (r * group + j) * head_dim;
      load_row(source, q, head_dim);
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) q[d] *= scale;
    }
  }
  // Where each of the partition's tokens lies in the key cache (the value cache has the same
  // strides); read in place, no copy.
  const int64_t end = begin + longest;
  for (int64_t b = begin / block_size, t = begin; t < end; ++b) {
    const int64_t block = table[b] * g.cache_stride_block + kv_head * g.cache_stride_head - b * block_size * g.cache_stride_token;
    for (const int64_t stop = std::min(end, (b + 1) * block_size); t < stop; ++t) s.rows[t - begin] = block + t * g.cache_stride_token;
  }
  const auto row_pointers = [&](const T* cache) {
    for (int64_t t = 0; t < longest; ++t) s.pointers[t] = cache + s.rows[t];
  };
  float* scores = s.scores.data();
  row_pointers(key_cache);
#if defined(__AVX2__)
  if (head_dim % 8 == 0 && !(kAvx512 && register_head(head_dim))) {
    // The partition's key (then value) rows as float rows: in place, or widened once.
    const auto float_rows = [&]() {
      for (int64_t t = 0; t < longest; ++t) {
        if constexpr (std::is_same_v<T, float>) {
          s.float_rows[t] = s.pointers[t];
        } else {
          float* target = s.widened.data() + t * head_dim;
          load_row(s.pointers[t], target, head_dim);
          s.float_rows[t] = target;
        }
      }
      return s.float_rows.data();
    };
    avx2::score(s.q.data(), float_rows(), counts, n, group, head_dim, longest, scores);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < group; ++j) {
        if (softcap > 0.f) soft_cap(scores + (r * group + j) * kPartition, counts[r], softcap);
        avx2::softmax_unnormalised(scores + (r * group + j) * kPartition, counts[r], maxima + slots[r] * group + j,
                                   sums + slots[r] * group + j);
      }
    }
    row_pointers(value_cache);
    avx2::accumulate(scores, float_rows(), counts, n, group, head_dim, s.acc.data());
    for (int64_t r = 0; r < n; ++r)
      std::copy(s.acc.data() + r * group * head_dim, s.acc.data() + (r + 1) * group * head_dim,
                partial + slots[r] * group * head_dim);
    return;
  }
#endif
#if defined(__AVX512F__)
  // The caches share strides: a token's value row lies this many bytes from its key row.
  const std::ptrdiff_t value_offset = reinterpret_cast<std::intptr_t>(value_cache) - reinterpret_cast<std::intptr_t>(key_cache);
  const bool wide = register_head(head_dim);
  // Rows that are enough heads together to pay for a tile's transpose take the block kernels
  // (head sizes 64 and 128); decode rows of 8 heads or fewer stay on the row kernels.
  const bool block = n * group >= kBlockHeads;
  if (wide) {  // each row's scores at stride counts[r] in its own region
    by_head_size(head_dim, [&](auto c) {
      constexpr int C = decltype(c)::value;
      if constexpr (C <= 8) {
        if (block) {
          return score_block<C>(s.q.data(), s.pointers.data(), counts, n, group, scores, s.tile_sums.data(),
                                value_offset);
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        score_rows<C>(s.q.data() + r * group * head_dim, s.pointers.data(), counts[r], group,
                      scores + r * group * kPartition, value_offset);
      }
    });
  } else
#endif
    score_rows_any(s.q.data(), s.pointers.data(), counts, n, group, head_dim, s.buffer.data(), scores);
  for (int64_t r = 0; r < n; ++r) {
#if defined(__AVX512F__)
    const int64_t stride = wide ? counts[r] : kPartition;
#else
    const int64_t stride = kPartition;
#endif
    for (int64_t j = 0; j < group; ++j) {
      if (softcap > 0.f) soft_cap(scores + r * group * kPartition + j * stride, counts[r], softcap);
      softmax_unnormalised(scores + r * group * kPartition + j * stride, counts[r], maxima + slots[r] * group + j,
                           sums + slots[r] * group + j);
    }
  }
  row_pointers(value_cache);
#if defined(__AVX512F__)
  if (wide) {  // straight into each row's slot
    by_head_size(head_dim, [&](auto c) {
      constexpr int C = decltype(c)::value;
      if constexpr (C <= 8) {
        if (block) return accumulate_block<C>(scores, s.pointers.data(), counts, n, group, slots, partial);
      }
      for (int64_t r = 0; r < n; ++r) {
        accumulate_rows<C>(scores + r * group * kPartition, s.pointers.data(), counts[r], group,
                           partial + slots[r] * group * head_dim);
      }
    });
    return;
  }
#endif
  float* acc = s.acc.data();
  accumulate_rows_any(scores, s.pointers.data(), counts, n, group, head_dim, s.buffer.data(), acc);
  for (int64_t r = 0; r < n; ++r)
    std::copy(acc + r * group * head_dim, acc + (r + 1) * group * head_dim, partial + slots[r] * group * head_dim);
}

// The partitions' maxima, sums and outputs, kept from call to call on this thread: a prefill
// chunk's are megabytes, which a fresh vector would zero and page-fault in on every layer.
inline float* kept_partials(int64_t n) {
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Attention of every query row over its sequence's first lengths[r] tokens. Rows
// [row_groups[i], row_groups[i + 1]) share block table i (a prefill chunk's rows, or one
// decode); their partitions of kPartition keys are cut at the same positions, so a block of
// kRowBlock rows reads each key once for all of them. A row's result depends only on its own
// query, length and keys: a prompt row is attended exactly as a decode row.
template <typename T>
void attend_rows(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& context_lens, const std::vector<int64_t>& row_groups,
                 double scale, int64_t sliding_window, double softcap, const float* sinks, int64_t chunk) {
  const int64_t num_rows = query.size(0);
  const Geometry g(query, key_cache, block_tables);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lengths = context_lens.data_ptr<int32_t>();
  // Each row's visible range [first, length) and where its partitions' slots start.
  std::vector<int64_t> first(num_rows), slot_offset(num_rows + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t length = lengths[r];
    // A window: the last sliding_window keys; chunked attention (Llama 4): the row's chunk.
    first[r] = sliding_window > 0 ? std::max<int64_t>(0, length - sliding_window)
               : chunk > 0        ? std::max<int64_t>(0, (length - 1) / chunk * chunk)
                                  : 0;
    const int64_t visible = std::max<int64_t>(length - first[r], 0);
    slot_offset[r + 1] = slot_offset[r] + std::max<int64_t>(1, (visible + kPartition - 1) / kPartition);
  }
  const int64_t slots_per_head = slot_offset[num_rows];
  // Work items: (table, block of rows, partition). A block's rows start their partitions at
  // the same key: with a sliding window or chunks, rows that see from different keys are
  // blocks of their own (the rows of a prompt within its window share one).
  struct Item {
    int64_t table, first_row, num_rows, partition;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i + 1 < static_cast<int64_t>(row_groups.size()); ++i) {
    for (int64_t r0 = row_groups[i], n = 1; r0 < row_groups[i + 1]; r0 += n) {
      n = 1;  // up to kRowBlock rows whose first visible key is the same
      while (n < kRowBlock && r0 + n < row_groups[i + 1] && first[r0 + n] == first[r0]) ++n;
      int64_t partitions = 0;
      for (int64_t r = r0; r < r0 + n; ++r) partitions = std::max(partitions, slot_offset[r + 1] - slot_offset[r]);
      for (int64_t p = 0; p < partitions; ++p) items.push_back(Item{i, r0, n, p});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  // Partials: [kv head, slot, group] max and sum, [kv head, slot, group, D] output.
  const int64_t num_slots = slots_per_head * g.num_kv_heads;
  // Every slot is written before the combine reads it: the buffer is neither zeroed nor fresh.
  float* maxima = kept_partials(num_slots * g.group * (g.head_dim + 2));
  float* sums = maxima + num_slots * g.group;
  float* partial = sums + num_slots * g.group;

  const T* q_data = query.data_ptr<T>();
  const T* k_data = key_cache.data_ptr<T>();
  const T* v_data = value_cache.data_ptr<T>();
  const float scale_f = static_cast<float>(scale), softcap_f = static_cast<float>(softcap);

  at::parallel_for(0, num_items * g.num_kv_heads, 1, [&](int64_t start, int64_t stop) {
    Scratch<T> scratch(g);
    int64_t slots[kRowBlock], active_rows[kRowBlock];
    for (int64_t index = start; index < stop; ++index) {
      const int64_t kv_head = index / num_items;
      const Item& it = items[index % num_items];
      // The rows that have this partition, and how many of its keys each sees.
      int64_t n = 0, begin = 0;
      for (int64_t r = it.first_row; r < it.first_row + it.num_rows; ++r) {
        if (it.partition >= slot_offset[r + 1] - slot_offset[r]) continue;
        begin = first[r] + it.partition * kPartition;
        const int64_t count = std::min<int64_t>(begin + kPartition, lengths[r]) - begin;
        const int64_t slot = kv_head * slots_per_head + slot_offset[r] + it.partition;
        if (count <= 0) {  // an empty context: attention is all zeros
          std::fill(maxima + slot * g.group, maxima + (slot + 1) * g.group, -std::numeric_limits<float>::infinity());
          std::fill(sums + slot * g.group, sums + (slot + 1) * g.group, 0.f);
          std::fill(partial + slot * g.group * g.head_dim, partial + (slot + 1) * g.group * g.head_dim, 0.f);
          continue;
        }
        active_rows[n] = r;
        scratch.counts[n] = count;
        slots[n] = slot;
        ++n;
      }
      // Active rows are consecutive (longer rows follow shorter ones in a chunk, and every
      // row has the partitions before its last), so they form one block from active_rows[0].
      for (int64_t b = 0; b < n;) {
        int64_t e = b + 1;
        while (e < n && active_rows[e] == active_rows[e - 1] + 1) ++e;
        if (b > 0) {
          std::copy(scratch.counts.begin() + b, scratch.counts.begin() + e, scratch.counts.begin());
          std::copy(slots + b, slots + e, slots);
        }
        attend_partition<T>(q_data, k_data, v_data, tables + it.table * g.max_blocks, g, active_rows[b], e - b,
                            kv_head, begin, scale_f, softcap_f, scratch, slots, maxima, sums, partial);
        b = e;
      }
    }
  });

  T* out_data = out.data_ptr<T>();
  const int64_t out_stride_token = out.stride(0), out_stride_head = out.stride(1);
  at::parallel_for(0, num_rows * g.num_kv_heads, 16, [&](int64_t start, int64_t stop) {
    std::vector<float> combined(g.head_dim);
    for (int64_t pair = start; pair < stop; ++pair) {
      const int64_t row = pair / g.num_kv_heads, kv_head = pair % g.num_kv_heads;
      const int64_t slots_begin = kv_head * slots_per_head + slot_offset[row];
      const int64_t slots_end = kv_head * slots_per_head + slot_offset[row + 1];
      for (int64_t j = 0; j < g.group; ++j) {
        // A sink (gpt-oss) is one more logit in the softmax's denominator, with no value.
        const float sink = sinks ? sinks[kv_head * g.group + j] : -std::numeric_limits<float>::infinity();
        float maximum = sink;
        for (int64_t slot = slots_begin; slot < slots_end; ++slot) maximum = std::max(maximum, maxima[slot * g.group + j]);
        std::fill(combined.begin(), combined.end(), 0.f);
        float total = sinks ? std::exp(sink - maximum) : 0.f;
        for (int64_t slot = slots_begin; slot < slots_end; ++slot) {
          const float sum = sums[slot * g.group + j];
          if (sum == 0.f) continue;
          const float weight = std::exp(maxima[slot * g.group + j] - maximum);
          total += weight * sum;
          const float* acc = partial + (slot * g.group + j) * g.head_dim;
#pragma omp simd
          for (int64_t d = 0; d < g.head_dim; ++d) combined[d] += weight * acc[d];
        }
        const float inverse = total > 0.f ? 1.f / total : 0.f;
        T* destination = out_data + row * out_stride_token + (kv_head * g.group + j) * out_stride_head;
        for (int64_t d = 0; d < g.head_dim; ++d) narrow(combined[d] * inverse, destination + d);
      }
    }
  });
}

at::Tensor attend(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& context_lens, const std::vector<int64_t>& row_groups,
                  double scale, int64_t sliding_window, double softcap, const std::optional<at::Tensor>& sinks,
                  int64_t chunk) {
  at::Tensor out = at::empty_like(query, query.options().memory_format(at::MemoryFormat::Contiguous));
  if (query.size(0) == 0) return out;
  at::Tensor sink_logits;
  if (sinks.has_value()) {
    sink_logits = sinks->to(at::kFloat).contiguous();
    TORCH_CHECK(sink_logits.dim() == 1 && sink_logits.size(0) == query.size(1), "sinks: one logit per query head");
  }
  const float* sink_data = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
  switch (query.scalar_type()) {
    case at::kFloat:
      attend_rows<float>(out, query, key_cache, value_cache, block_tables, context_lens, row_groups, scale, sliding_window,
                         softcap, sink_data, chunk);
      break;
    case at::kBFloat16:
      attend_rows<c10::BFloat16>(out, query, key_cache, value_cache, block_tables, context_lens, row_groups, scale,
                                 sliding_window, softcap, sink_data, chunk);
      break;
    default:
      TORCH_CHECK(false, "float32 or bfloat16 only, got ", query.scalar_type());
  }
  return out;
}

// One query token per sequence: row s over its table s.
at::Tensor paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t sliding_window, double softcap, const std::optional<at::Tensor>& sinks,
                                  int64_t chunk) {
  check_paged_args(query, key_cache, value_cache, {block_tables, context_lens});
  TORCH_CHECK(block_tables.size(0) == query.size(0) && context_lens.size(0) == query.size(0),
              "a block table and a length per query row");
  std::vector<int64_t> row_groups(query.size(0) + 1);
  std::iota(row_groups.begin(), row_groups.end(), 0);
  return attend(query, key_cache, value_cache, block_tables.contiguous(), context_lens.contiguous(), row_groups, scale,
                sliding_window, softcap, sinks, chunk);
}

// Any rows: row r sees the first context_lens[r] tokens of the sequence whose block table is
// i for rows [row_groups[i], row_groups[i + 1]) (a prefill chunk's rows attend causally
// with lengths position + 1), with the decode operator's arithmetic.
at::Tensor paged_attention_rows(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                const at::Tensor& block_tables, const at::Tensor& context_lens,
                                const at::Tensor& row_groups, double scale, int64_t sliding_window,
                                double softcap, const std::optional<at::Tensor>& sinks, int64_t chunk) {
  check_paged_args(query, key_cache, value_cache, {block_tables, context_lens, row_groups});
  const at::Tensor groups = row_groups.contiguous();
  const int32_t* offsets = groups.data_ptr<int32_t>();
  const int64_t num_groups = groups.size(0) - 1;
  TORCH_CHECK(groups.dim() == 1 && num_groups == block_tables.size(0) && offsets[0] == 0 &&
                  offsets[num_groups] == query.size(0) && context_lens.size(0) == query.size(0),
              "row_groups [num_tables + 1] from 0 to the number of rows, a length per row");
  std::vector<int64_t> bounds(offsets, offsets + num_groups + 1);
  for (int64_t i = 0; i < num_groups; ++i) TORCH_CHECK(bounds[i] <= bounds[i + 1], "row_groups must not decrease");
  return attend(query, key_cache, value_cache, block_tables.contiguous(), context_lens.contiguous(), bounds, scale,
                sliding_window, softcap, sinks, chunk);
}

// Writes each new token's keys and values into its cache slot (block * block_size + offset;
// a negative slot skips the token): one call for both caches, where the torch path needs a
// mask, a sync and an index_copy_ per cache on every layer of every step.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  check_paged_args(key, key_cache, value_cache, {});
  TORCH_CHECK(value.sizes() == key.sizes() && value.stride(2) == 1 && value.scalar_type() == key.scalar_type(),
              "value must have the key's shape and dtype, head_dim contiguous");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3), "key [T, KVH, D] must fit the cache");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping [T]");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  for (int64_t t = 0; t < num_tokens; ++t) TORCH_CHECK(slot[t] < num_slots, "slot ", slot[t], " is past the cache");
  const int64_t row_bytes = key.size(2) * key.element_size();
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  const int64_t e = key.element_size();
  at::parallel_for(0, num_tokens, 256, [&](int64_t start, int64_t stop) {
    for (int64_t t = start; t < stop; ++t) {
      if (slot[t] < 0) continue;
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      const int64_t target = block * key_cache.stride(0) + offset * key_cache.stride(1);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t to = (target + h * key_cache.stride(2)) * e;
        std::memcpy(kc + to, k + (t * key.stride(0) + h * key.stride(1)) * e, row_bytes);
        std::memcpy(vc + to, v + (t * value.stride(0) + h * value.stride(1)) * e, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagefleet, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention_decode(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, int sliding_window, float softcap=0.0, Tensor? sinks=None, "
      "int chunk=0) -> Tensor");
  m.def(
      "paged_attention_rows(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor context_lens, Tensor row_groups, float scale, int sliding_window, float softcap=0.0, "
      "Tensor? sinks=None, int chunk=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) {
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("paged_attention_rows", &paged_attention_rows);
  m.impl("reshape_and_cache", &reshape_and_cache);
}
