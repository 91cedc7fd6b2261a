// The quantized matmul on AVX-512 VNNI, included by cpu_quant.cpp inside its namespace and
// a `#pragma GCC target` region (the build's flags stop at AVX-512F; VNNI is checked at run
// time). Two blocks per 512-bit vpdpbusd, a tile of up to 4 activation rows by 2 weight
// columns in registers. Activations come in the pair layout (QuantizedActivations).
#pragma once

// A weight row's codes take one of four layouts (kCodeBits): 8, a byte each; 4, two a byte,
// block b's 16 bytes holding its elements 0-15 in the low nibbles and 16-31 in the high; 5 and
// 6, the 4-bit layout of the codes' low nibbles (in_features / 2 bytes), then their high bits
// in planes, 8 bytes a block pair for 5-bit, 16 for 6-bit (0.63 and 0.75 bytes a weight where
// a byte each took 1). In a pair's plane bytes, byte j holds the high bits of pair positions
// j + 8i at bit i (5-bit) or j + 16i at bits 2i, 2i + 1 (6-bit), so that one broadcast and one
// rotation per 64-bit lane put every weight's high bits above its nibble: 3 instructions a
// pair for the nibbles and 3 for the planes, where a shift, mask and or each took 10.
template <int kCodeBits>
constexpr int64_t row_bytes(int64_t in_features) {
  return kCodeBits == 8 ? in_features : in_features / 2 + (kCodeBits - 4) * in_features / 8;
}

// Blocks b and b + 1 (b even) of a weight row as 64 unsigned bytes in the pair layout: b's
// elements 0-15, b+1's 0-15, b's 16-31, b+1's 16-31.
template <int kCodeBits>
inline __m512i load_pair(const uint8_t* row, int64_t b, int64_t in_features) {
  if constexpr (kCodeBits == 8) {
    const __m512i bytes = _mm512_loadu_si512(row + b * kBlock);
    return _mm512_shuffle_i64x2(bytes, bytes, _MM_SHUFFLE(3, 1, 2, 0));
  } else {
    // The pair's 32 bytes in both halves, the upper half shifted down a nibble.
    const __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 16)));
    const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi64(bytes, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)),
                                             _mm512_set1_epi8(0x0F));
    if constexpr (kCodeBits == 4) {
      return nibbles;
    } else {
      // Each 64-bit lane's own bits of the plane bytes rotated to bit 4 (5-bit: bit i of lane
      // i; 6-bit: bits 2i, 2i + 1 of lanes 2i, 2i + 1), then kept and or-ed in (0xF8: a | b & c).
      constexpr int kPlanes = kCodeBits - 4;
      const uint8_t* planes = row + in_features / 2 + b / 2 * 8 * kPlanes;
      __m512i spread, turns;
      if constexpr (kPlanes == 1) {
        int64_t word;
        std::memcpy(&word, planes, sizeof(word));
        spread = _mm512_set1_epi64(word);
        turns = _mm512_set_epi64(61, 62, 63, 0, 1, 2, 3, 4);
      } else {
        spread = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(planes)));
        turns = _mm512_set_epi64(62, 62, 0, 0, 2, 2, 4, 4);
      }
      const __m512i mask = _mm512_set1_epi8(static_cast<char>(((1 << kPlanes) - 1) << 4));
      return _mm512_ternarylogic_epi32(nibbles, _mm512_rolv_epi64(spread, turns), mask, 0xF8);
    }
  }
}

// vpdpbusd's 16 lanes over a pair: lanes 0-3 and 8-11 belong to block b, 4-7 and 12-15 to b+1.
inline __m512 pair_lanes(float first, float second) {
  const __m512i index = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(_mm_set_ps(0.f, 0.f, second, first)));
}

// Four scales over the lanes: a for lanes 0-3, b for 4-7, c for 8-11, d for 12-15 (a pair of
// blocks whose halves of 16 each have a scale: b's 0-15, b+1's 0-15, b's 16-31, b+1's 16-31).
inline __m512 quad_lanes(float a, float b, float c, float d) {
  const __m512i index = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(_mm_set_ps(d, c, b, a)));
}

// A column's scales (float32, padded to a multiple of 16) spread over each pair's lanes as
// pair_lanes / quad_lanes place them, one permutation a pair: 16 scales cover 8 pairs (a scale
// a block) or 4 (a scale per 16: lanes of groups 4p, 4p + 2, 4p + 1, 4p + 3).
inline void spread_over_lanes(const float* scales, int64_t num_pairs, int64_t groups_per_block, __m512* out) {
  const int64_t pairs_per_vector = 16 / (2 * groups_per_block);
  const __m512i lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // each lane's quarter
  const __m512i order = groups_per_block == 2 ? _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0)
                                              : _mm512_and_si512(lane, _mm512_set1_epi32(1));
  for (int64_t p0 = 0; p0 < num_pairs; p0 += pairs_per_vector) {
    const __m512 vector = _mm512_loadu_ps(scales + p0 * 2 * groups_per_block);
    for (int64_t p = p0; p < std::min(num_pairs, p0 + pairs_per_vector); ++p) {
      const __m512i first = _mm512_set1_epi32(static_cast<int>((p - p0) * 2 * groups_per_block));
      out[p] = _mm512_permutexvar_ps(_mm512_add_epi32(first, order), vector);
    }
  }
}

inline float scale_at(const at::Half* scales, int64_t index) { return static_cast<float>(scales[index]); }

// sum over groups (blocks, or halves of 16) of min_w * d_x * sum(q_x): the offset of the
// unsigned weights. With no mins stored (6-bit codes: Q6_K's) each min is -32 times its scale,
// exactly the float16 min GGUF's blocks give, so the sum is the same bits either way.
inline float min_term(const at::Half* mins, const at::Half* scales, const float* scaled_sums, int64_t num_groups) {
  const at::Half* source = mins != nullptr ? mins : scales;
  const float factor = mins != nullptr ? 1.f : -32.f;
  __m512 acc = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= num_groups; g += 16) {
    const __m512 halves = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source + g)));
    acc = _mm512_fmadd_ps(_mm512_mul_ps(halves, _mm512_set1_ps(factor)), _mm512_loadu_ps(scaled_sums + g), acc);
  }
  float total = _mm512_reduce_add_ps(acc);
  for (; g < num_groups; ++g) total += scale_at(source, g) * factor * scaled_sums[g];
  return total;
}

// out[m, n] for rows [m0, m0 + kRows) and columns [n0, n0 + kCols): the integer dots of
// every block pair, each lane scaled by its d_w * d_x; an odd last block 256 bits wide
// (4- and 8-bit codes with scales per 32 only: the other layouts hold whole pairs).
template <int kCodeBits, int kRows, int kCols>
void tile(const QuantizedActivations& x, const __m512* activation_pair_scales, const __m512* weight_pair_scales,
          const uint8_t* quants, const at::Half* scales, const at::Half* mins, int64_t in_features,
          int64_t groups_per_block, int64_t m0, int64_t n0, float* out, int64_t out_stride) {
  const int64_t num_blocks = in_features / kBlock, num_pairs = num_blocks / 2;
  const int64_t num_groups = num_blocks * groups_per_block;
  const float* group_sums = groups_per_block == 2 ? x.half_sums : x.scaled_sums;
  const int64_t weight_row_bytes = row_bytes<kCodeBits>(in_features);
  __m512 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < num_pairs; ++p) {
    __m512i weights[kCols];
    __m512 weight_scales[kCols];
    for (int c = 0; c < kCols; ++c) {
      const int64_t n = n0 + c;
      weights[c] = load_pair<kCodeBits>(quants + n * weight_row_bytes, 2 * p, in_features);
      weight_scales[c] = weight_pair_scales[c * num_pairs + p];
    }
    for (int r = 0; r < kRows; ++r) {
      const int64_t m = m0 + r;
      const __m512i values = _mm512_loadu_si512(x.quants + m * in_features + p * 2 * kBlock);
      const __m512 activation_scales = activation_pair_scales[m * num_pairs + p];
      for (int c = 0; c < kCols; ++c) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), weights[c], values));
        acc[r][c] = _mm512_fmadd_ps(dot, _mm512_mul_ps(weight_scales[c], activation_scales), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kCols; ++c) {
      const int64_t m = m0 + r, n = n0 + c;
      float total = _mm512_reduce_add_ps(acc[r][c]);
      if (num_blocks % 2) {  // the odd last block, in natural order
        const int64_t b = num_blocks - 1;
        const uint8_t* row = quants + n * weight_row_bytes;
        __m256i weights;
        if constexpr (kCodeBits != 8) {
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * (kBlock / 2)));
          const __m128i low_mask = _mm_set1_epi8(0x0F);
          weights = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask), _mm_and_si128(bytes, low_mask));
        } else {
          weights = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
        }
        const __m256i values = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.quants + m * in_features + b * kBlock));
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), weights, values);
        const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(dot), _mm256_extracti128_si256(dot, 1));
        const int sum = _mm_cvtsi128_si32(half) + _mm_extract_epi32(half, 1) + _mm_extract_epi32(half, 2) +
                        _mm_extract_epi32(half, 3);
        total += static_cast<float>(sum) * scale_at(scales, n * num_blocks + b) * x.scales[m * num_blocks + b];
      }
      const at::Half* column_mins = mins != nullptr ? mins + n * num_groups : nullptr;
      out[m * out_stride + n] =
          total + min_term(column_mins, scales + n * num_groups, group_sums + m * num_groups, num_groups);
    }
  }
}

template <int kCodeBits, int kCols>
void rows_of_tile(const QuantizedActivations& x, const __m512* pair_scales, const __m512* weight_pair_scales,
                  const uint8_t* quants, const at::Half* scales, const at::Half* mins, int64_t in_features,
                  int64_t groups_per_block, int64_t m0, int rows, int64_t n0, float* out, int64_t out_stride) {
  switch (rows) {
    case 4: return tile<kCodeBits, 4, kCols>(x, pair_scales, weight_pair_scales, quants, scales, mins, in_features, groups_per_block, m0, n0, out, out_stride);
    case 3: return tile<kCodeBits, 3, kCols>(x, pair_scales, weight_pair_scales, quants, scales, mins, in_features, groups_per_block, m0, n0, out, out_stride);
    case 2: return tile<kCodeBits, 2, kCols>(x, pair_scales, weight_pair_scales, quants, scales, mins, in_features, groups_per_block, m0, n0, out, out_stride);
    default: return tile<kCodeBits, 1, kCols>(x, pair_scales, weight_pair_scales, quants, scales, mins, in_features, groups_per_block, m0, n0, out, out_stride);
  }
}

constexpr int64_t kRowBlock = 64;  // activation rows whose quants stay in L1/L2 while a thread's columns pass

// Columns [first, last), every row: tiles of 4 rows by 2 columns, rows in blocks of 64.
template <int kCodeBits>
void columns(const QuantizedActivations& x, const __m512* pair_scales, const uint8_t* quants,
             const at::Half* scales, const at::Half* mins, int64_t in_features, int64_t groups_per_block,
             int64_t first, int64_t last, float* out, int64_t out_stride) {
  const int64_t num_blocks = in_features / kBlock, num_pairs = num_blocks / 2;
  const int64_t num_groups = num_blocks * groups_per_block;
  std::vector<float> column_scales((num_groups + 15) / 16 * 16, 0.f);
  std::vector<__m512> weight_pair_scales(2 * num_pairs);  // the tile's two columns' scales over the lanes
  for (int64_t row_block = 0; row_block < x.rows; row_block += kRowBlock) {
    const int64_t row_end = std::min(x.rows, row_block + kRowBlock);
    for (int64_t n = first; n < last; n += 2) {
      const int columns_here = n + 1 < last ? 2 : 1;
      // The next two weight rows, ahead: two rows read side by side are two interleaved
      // streams, which the hardware prefetcher follows badly (2x slower at one row).
      const int64_t weight_row_bytes = row_bytes<kCodeBits>(in_features);
      const int64_t next = std::min(n + 2, last), next_end = std::min(n + 4, last);
      for (const uint8_t* line = quants + next * weight_row_bytes; line < quants + next_end * weight_row_bytes;
           line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
      for (int c = 0; c < columns_here; ++c) {
        const at::Half* column = scales + (n + c) * num_groups;
        int64_t g = 0;
        for (; g + 16 <= num_groups; g += 16)
          _mm512_storeu_ps(column_scales.data() + g,
                           _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + g))));
        for (; g < num_groups; ++g) column_scales[g] = scale_at(column, g);
        spread_over_lanes(column_scales.data(), num_pairs, groups_per_block, weight_pair_scales.data() + c * num_pairs);
      }
      for (int64_t m = row_block; m < row_end; m += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, row_end - m));
        if (columns_here == 2) {
          rows_of_tile<kCodeBits, 2>(x, pair_scales, weight_pair_scales.data(), quants, scales, mins, in_features,
                                    groups_per_block, m, rows, n, out, out_stride);
        } else {
          rows_of_tile<kCodeBits, 1>(x, pair_scales, weight_pair_scales.data(), quants, scales, mins, in_features,
                                    groups_per_block, m, rows, n, out, out_stride);
        }
      }
    }
  }
}
