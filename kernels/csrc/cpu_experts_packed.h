// The fused-experts operator on bfloat16 weights packed for AMX tiles (cpu_experts_amx.h
// `multiply_packed`, kernels/amx_tiles.py), in two phases:
//
//   1. per item (up to kRowsPerItem rows of one expert, items over the threads):
//      the rows gathered, gate/up sums activated block by block as they leave the tiles,
//      into `activated` [pairs, I], listed as the groups list the pairs (an expert's rows
//      contiguous);
//   2. per slice of output columns (slices over the threads): every expert in ascending
//      order, its down sums finished (rounded, bias, routing weight) block by block and
//      added into the tokens' output rows.
//
// Each thread owns its columns and takes the experts in ascending order, so a token's
// output adds its contributions in ascending expert order, each add rounded to bfloat16:
// the bits of cpu_experts_rows.h's finish_row and sum_in_expert_order, without their
// [pairs, H] buffer (a 2,048-token chunk's is 32 MB written, then read back).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_experts_amx.h"
#include "cpu_experts_rows.h"
#include "cpu_vec.h"

namespace pagefleet::experts_packed {

#if defined(__AVX512F__)
using BFloat16 = c10::BFloat16;
using namespace expert_rows;

struct PackedExperts {
  const BFloat16* hidden;
  int64_t hidden_stride;
  const float* weights;                 // [T, k]
  const BFloat16 *gate_up, *down;       // packed
  const BFloat16 *gate_up_bias, *down_bias;  // or null
  int64_t top_k, hidden_size, width;
  Activation activation;
};

// A thread's buffer of n values, kept from call to call (zeroing it per call cost a decode
// step's layer about 4%); tiles read 16 rows at a time, so callers size it 16 rows over.
template <typename T, int kWhich>
T* kept_buffer(int64_t n) {
  static thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// Phase 1 for one item: rows i of `activated` for the item's pairs i.
inline void activate_item(const PackedExperts& p, const Groups& groups, const Item& item, BFloat16* activated) {
  const int64_t hidden = p.hidden_size, width = p.width, rows = item.end - item.first;
  BFloat16* gathered = kept_buffer<BFloat16, 0>((kRowsPerItem + 16) * hidden);
  float* staging = kept_buffer<float, 1>(32 * 32);
  for (int64_t r = 0; r < rows; ++r) {
    const BFloat16* row = p.hidden + groups.pairs[item.first + r] / p.top_k * p.hidden_stride;
    std::copy(row, row + hidden, gathered + r * hidden);
  }
  constexpr BFloat16* tag = nullptr;
  const BFloat16* bias = p.gate_up_bias ? p.gate_up_bias + item.expert * 2 * width : nullptr;
  BFloat16* target = activated + item.first * width;
  // Block j: gate outputs j * 16 .. in sums[r][0 .. 16), up's in sums[r][16 .. 32).
  const auto activate = [&](int64_t first, int64_t tokens, int64_t j, const float* sums) {
    for (int64_t r = 0; r < tokens; ++r, sums += 32) {
      __m512 gate = round_as(tag, _mm512_loadu_ps(sums)), up = round_as(tag, _mm512_loadu_ps(sums + 16));
      if (bias != nullptr) {
        gate = round_as(tag, _mm512_add_ps(gate, load16(bias + j * 16)));
        up = round_as(tag, _mm512_add_ps(up, load16(bias + width + j * 16)));
      }
      store16(target + (first + r) * width + j * 16, activate16<BFloat16>(gate, up, p.activation));
    }
  };
  experts_amx::multiply_packed(gathered, rows, hidden, p.gate_up + item.expert * 2 * width * hidden, 0, width / 16, 1,
                               width / 16, staging, activate);
}

// Phase 2 for output columns [32 * b0, 32 * b1): every expert's rows of `activated`.
inline void add_down_columns(const PackedExperts& p, const Groups& groups, const BFloat16* activated, int64_t b0,
                             int64_t b1, BFloat16* out) {
  const int64_t hidden = p.hidden_size, width = p.width;
  float* staging = kept_buffer<float, 1>(32 * 32);
  constexpr BFloat16* tag = nullptr;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(groups.offsets.size()); ++e) {
    const int64_t begin = groups.offsets[e], rows = groups.offsets[e + 1] - begin;
    if (rows == 0) continue;
    const BFloat16* bias = p.down_bias ? p.down_bias + e * hidden : nullptr;
    // Block j: outputs j * 32 .. in sums[r][0 .. 32).
    const auto add = [&](int64_t first, int64_t tokens, int64_t j, const float* sums) {
      for (int64_t r = 0; r < tokens; ++r, sums += 32) {
        const int64_t pair = groups.pairs[begin + first + r];
        const __m512 weight = _mm512_set1_ps(p.weights[pair]);
        BFloat16* row = out + pair / p.top_k * hidden + j * 32;
        for (int64_t h = 0; h < 32; h += 16) {
          __m512 value = round_as(tag, _mm512_loadu_ps(sums + h));
          if (bias != nullptr) value = round_as(tag, _mm512_add_ps(value, load16(bias + j * 32 + h)));
          const __m512 contribution = round_as(tag, _mm512_mul_ps(value, weight));
          store16(row + h, _mm512_add_ps(load16(row + h), contribution));
        }
      }
    };
    experts_amx::multiply_packed(activated + begin * width, rows, width, p.down + e * hidden * width, b0, b1, 2, 1,
                                 staging, add);
  }
}

// out [T, H] (zeros on entry) += every pair's contribution, in ascending expert order.
inline void run_packed_experts(const PackedExperts& p, const Groups& groups, BFloat16* out) {
  const int64_t num_pairs = static_cast<int64_t>(groups.pairs.size());
  BFloat16* activated = kept_buffer<BFloat16, 2>((num_pairs + 16) * p.width);  // the calling thread's
  for_each_item(
      groups, 3 * p.hidden_size * p.width, [] { return 0; },
      [&](const Item& item, int) { activate_item(p, groups, item, activated); });
  const int64_t blocks = p.hidden_size / 32;
  const bool serial = num_pairs * p.hidden_size * p.width < kSerialMacs;
  at::parallel_for(0, blocks, serial ? blocks : 1,
                   [&](int64_t b0, int64_t b1) { add_down_columns(p, groups, activated, b0, b1, out); });
}
#endif

}  // namespace pagefleet::experts_packed
