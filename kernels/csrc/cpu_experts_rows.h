// The row-level pieces of the routed-experts operators (cpu_experts.cpp on float weights,
// cpu_quant_experts.h on GGML blocks): pairs grouped by expert, a gate/up row activated and
// a down row finished as the torch reference rounds them, and a token's contributions
// summed in ascending expert order. Shared so that both operators round alike.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_vec.h"

namespace pagefleet::expert_rows {

constexpr int64_t kRowsPerItem = 64;  // rows of one expert sharing each read of its weights (32: 6% slower at 512 tokens)
// Multiply-adds below which the experts run on the calling thread (a tiny test model's).
constexpr int64_t kSerialMacs = 1 << 18;

enum ActivationKind : int64_t { kSilu = 0, kGeluTanh = 1, kSwigluOai = 2 };

struct Activation {
  int64_t kind;
  float alpha, limit;
};

// The value as a T holds it, as float32 (float: itself; bfloat16: rounded to nearest even).
template <typename T>
inline float round_to(float value) {
  T rounded;
  narrow(value, &rounded);
  return widen(rounded);
}

// Pairs (token * k + slot) listed by expert, in token order within one: expert e's are
// pairs[offsets[e] .. offsets[e + 1]]. A pair whose expert is negative (held by another
// rank) is in no group: it is never computed.
struct Groups {
  std::vector<int64_t> offsets, pairs;
};

inline Groups group_by_expert(const int64_t* experts, int64_t num_pairs, int64_t num_experts) {
  Groups groups{std::vector<int64_t>(num_experts + 1, 0), {}};
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(experts[p] < num_experts, "experts: ", experts[p], " is not below ", num_experts);
    if (experts[p] >= 0) ++groups.offsets[experts[p] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) groups.offsets[e + 1] += groups.offsets[e];
  groups.pairs.resize(groups.offsets[num_experts]);
  std::vector<int64_t> next(groups.offsets.begin(), groups.offsets.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p)
    if (experts[p] >= 0) groups.pairs[next[experts[p]]++] = p;
  return groups;
}

#if defined(__AVX512F__)
// act(gate) * up on 16 lanes, every step rounded as its torch op rounds.
template <typename T>
__m512 activate16(__m512 gate, __m512 up, const Activation& activation) {
  constexpr T* tag = nullptr;
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  if (activation.kind == kSwigluOai) {
    const __m512 limit = _mm512_set1_ps(activation.limit);
    gate = _mm512_min_ps(gate, limit);
    up = _mm512_max_ps(_mm512_min_ps(up, limit), _mm512_sub_ps(zero, limit));
    const __m512 up_plus_one = round_as(tag, _mm512_add_ps(up, one));
    const __m512 scaled = round_as(tag, _mm512_mul_ps(gate, _mm512_set1_ps(activation.alpha)));
    const __m512 sigmoid = round_as(tag, _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, scaled)))));
    return round_as(tag, _mm512_mul_ps(up_plus_one, round_as(tag, _mm512_mul_ps(gate, sigmoid))));
  }
  __m512 a = gate;  // silu: g / (1 + exp(-g)); GELU's tanh form: the same with a = 2 sqrt(2/pi) (g + 0.044715 g^3)
  if (activation.kind == kGeluTanh)
    a = _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f),
                      _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), gate), _mm512_mul_ps(gate, gate), gate));
  const __m512 act = _mm512_div_ps(gate, _mm512_add_ps(one, exp16(_mm512_sub_ps(zero, a))));
  return round_as(tag, _mm512_mul_ps(round_as(tag, act), up));
}
#endif

template <typename T>
float activate(float gate, float up, const Activation& activation) {
  if (activation.kind == kSwigluOai) {
    gate = std::min(gate, activation.limit);
    up = std::max(std::min(up, activation.limit), -activation.limit);
    const float scaled = round_to<T>(gate * activation.alpha);
    const float sigmoid = round_to<T>(1.f / (1.f + std::exp(-scaled)));
    return round_to<T>(round_to<T>(up + 1.f) * round_to<T>(gate * sigmoid));
  }
  const float a = activation.kind == kGeluTanh ? 1.5957691216057308f * std::fma(0.044715f * gate, gate * gate, gate)
                                               : gate;
  return round_to<T>(round_to<T>(gate / (1.f + std::exp(-a))) * up);
}

// One row of gate/up sums [2I] -> activated [I]: rounded as F.linear's output, the bias
// added (rounded), then the activation.
template <typename T>
void activate_row(const float* projected, const T* bias, int64_t width, const Activation& activation, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  constexpr T* tag = nullptr;
  for (; i + 16 <= width; i += 16) {
    __m512 gate = round_as(tag, _mm512_loadu_ps(projected + i));
    __m512 up = round_as(tag, _mm512_loadu_ps(projected + width + i));
    if (bias != nullptr) {
      gate = round_as(tag, _mm512_add_ps(gate, load16(bias + i)));
      up = round_as(tag, _mm512_add_ps(up, load16(bias + width + i)));
    }
    _mm512_storeu_ps(out + i, activate16<T>(gate, up, activation));
  }
#endif
  for (; i < width; ++i) {
    float gate = round_to<T>(projected[i]), up = round_to<T>(projected[width + i]);
    if (bias != nullptr) {
      gate = round_to<T>(gate + widen(bias[i]));
      up = round_to<T>(up + widen(bias[width + i]));
    }
    out[i] = activate<T>(gate, up, activation);
  }
}

// One row of down sums [H] -> the pair's contribution: rounded, the bias added (rounded),
// times the routing weight (rounded), as `(routed * weight).to(dtype)`.
template <typename T>
void finish_row(const float* routed, const T* bias, float weight, int64_t size, T* out) {
  int64_t h = 0;
#if defined(__AVX512F__)
  constexpr T* tag = nullptr;
  const __m512 scale = _mm512_set1_ps(weight);
  for (; h + 16 <= size; h += 16) {
    __m512 value = round_as(tag, _mm512_loadu_ps(routed + h));
    if (bias != nullptr) value = round_as(tag, _mm512_add_ps(value, load16(bias + h)));
    store16(out + h, _mm512_mul_ps(value, scale));
  }
#endif
  for (; h < size; ++h) {
    float value = round_to<T>(routed[h]);
    if (bias != nullptr) value = round_to<T>(value + widen(bias[h]));
    narrow(value * weight, out + h);
  }
}

struct Item {
  int64_t expert, first, end;  // pairs[first .. end] of one expert
};

// The per-pair contributions [pairs, size], kept from call to call on this thread: a
// prefill chunk's are tens of MB, which a fresh allocation would map and page-fault in
// again on every layer (half a million faults in a short run).
inline at::Tensor contributions_buffer(int64_t pairs, int64_t size, const at::TensorOptions& options) {
  static thread_local at::Tensor cached;
  const int64_t needed = pairs * size;
  if (!cached.defined() || cached.scalar_type() != options.dtype().toScalarType() || cached.numel() < needed)
    cached = at::empty({std::max<int64_t>(needed, 1)}, options);
  return cached.narrow(0, 0, needed).view({pairs, size});
}

inline std::vector<Item> split_into_items(const Groups& groups) {
  std::vector<Item> items;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(groups.offsets.size()); ++e)
    for (int64_t first = groups.offsets[e]; first < groups.offsets[e + 1]; first += kRowsPerItem)
      items.push_back({e, first, std::min(groups.offsets[e + 1], first + kRowsPerItem)});
  return items;
}

// Every item of `groups` through run(item, workspace): items spread over torch's threads, a
// workspace per thread from make_workspace(); on the calling thread below kSerialMacs
// multiply-adds (a tiny test model's), where waking the pool costs more than the work.
template <typename MakeWorkspace, typename Run>
void for_each_item(const Groups& groups, int64_t macs_per_pair, MakeWorkspace make_workspace, Run run) {
  const std::vector<Item> items = split_into_items(groups);
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t macs = static_cast<int64_t>(groups.pairs.size()) * macs_per_pair;
  at::parallel_for(0, count, macs < kSerialMacs ? std::max<int64_t>(count, 1) : 1, [&](int64_t begin, int64_t end) {
    auto space = make_workspace();
    for (int64_t i = begin; i < end; ++i) run(items[i], space);
  });
}

// out[t] = sum of token t's contributions in ascending expert order, each add rounded to T;
// slots of negative experts (never computed) are left out, so a token with none gives 0.
template <typename T>
void sum_in_expert_order(const T* contributions, const int64_t* experts, int64_t num_tokens, int64_t top_k,
                         int64_t size, T* out) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, size * top_k));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order;
    order.reserve(top_k);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t* mine = experts + t * top_k;
      order.clear();
      for (int64_t s = 0; s < top_k; ++s)
        if (mine[s] >= 0) order.push_back(s);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return mine[a] < mine[b]; });
      int64_t h = 0;
#if defined(__AVX512F__)
      for (; h + 16 <= size; h += 16) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t s : order)
          sum = round_as(static_cast<T*>(nullptr), _mm512_add_ps(sum, load16(contributions + (t * top_k + s) * size + h)));
        store16(out + t * size + h, sum);
      }
#endif
      for (; h < size; ++h) {
        float sum = 0.f;
        for (int64_t s : order) sum = round_to<T>(sum + widen(contributions[(t * top_k + s) * size + h]));
        narrow(sum, out + t * size + h);
      }
    }
  });
}

}  // namespace pagefleet::expert_rows
