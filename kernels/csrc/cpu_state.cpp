// The state layers' recurrences for CPUs, over a flat batch of sequences that each own a
// state slot (the contracts are the torch references' docstrings in kernels/causal_conv1d.py,
// gated_delta_rule.py and selective_scan.py; the wrappers are in kernels/cpu_state.py):
//
//   causal_conv1d_state(x [T, C], weight [C, K], bias [C]?, conv_state [S, C, K-1] any strides,
//                       query_start [N + 1], slots [N], has_state [N], activation) -> [T, C]
//   gated_delta_rule_state(query, key [T, Hk, Dk], value [T, Hv, Dv], g, beta [T, Hv],
//                          state [S, Hv, Dk, Dv], query_start, slots, has_state, use_qk_l2norm)
//   selective_scan_state(x [T, H, P], dt [T, H], A [H], B, C [T, G, N], D, dt_bias [H],
//                        state [S, H, P, N], query_start, slots, has_state, dt_limit)
//
// The states are updated in place: the batch's slots end holding each sequence's final state,
// the others keep their bits. The references walk row positions in Python, a batch of small
// torch ops per position; here one work item walks its sequence's rows in order:
//
//   conv        (block of 64 channels, sequence): the window in a ring of K rows
//   delta rule  (value head, sequence): 32 columns of the [Dk, Dv] state at a time, kept in
//               L1 over the rows, two passes a row (decay and kv_mem; update and output)
//   scan        (head, sequence): 16 rows of the [P, N] state at a time
//
// Path invariance: an element's arithmetic is fixed by its place in the state (its column, its
// channel) and the state's shape, never by where a call's rows start, which sequences share
// the call or how the threads split it, and every sum over Dk or N runs in one fixed order
// (4 vectors of partial sums, then one tree), so a row's results are the same bits split
// across calls or batched. Items are numbered head (block) first, so torch's static split of
// the range gives each thread a share of every sequence. Sums and states are float32;
// bfloat16 rounds where the references round; multiply-adds are fused and sums run in another
// order, so results agree with the references to float32 rounding, not bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_state_rows.h"

namespace {

using namespace pagefleet;

// ---- causal_conv1d_state

template <typename T>
struct Conv {
  const T* x;
  int64_t x_stride;
  const T* weight;  // [C, K], row stride weight_stride
  int64_t weight_stride;
  const T* bias;  // [C] or nullptr
  T* state;
  int64_t state_stride[3];  // [S, C, K-1]
  T* out;                   // [T, C]
  int64_t channels, width;
  bool silu;
};

// An item's scratch: the ring of K ext columns, and its channels' taps [K][block] and bias,
// as float32 and zero past the last channel.
struct ConvScratch {
  AlignedFloats storage;
  float *ring, *taps, *bias;
  explicit ConvScratch(int64_t width)
      : storage((2 * width + 1) * kChannelBlock),
        ring(storage.data()),
        taps(ring + width * kChannelBlock),
        bias(taps + width * kChannelBlock) {}
};

// One row's outputs for the block's channels: acc = bias + sum_j tap_j * ext[i + j], rounded
// to the dtype as F.conv1d's result, then silu. `oldest` is the ring row of ext[i].
template <typename T>
inline void conv_row(const Conv<T>& conv, const ConvScratch& scratch, int64_t oldest, float* acc) {
  constexpr int kVectors = kChannelBlock / 8;
  const int64_t width = conv.width;
  Vec8 sums[kVectors];
  for (int u = 0; u < kVectors; ++u) sums[u] = load8(scratch.bias + 8 * u);
  for (int64_t j = 0, at = oldest; j < width; ++j, at = at + 1 == width ? 0 : at + 1) {
    const float* tap = scratch.taps + j * kChannelBlock;
    const float* column = scratch.ring + at * kChannelBlock;
    for (int u = 0; u < kVectors; ++u) sums[u] = load8(tap + 8 * u) * load8(column + 8 * u) + sums[u];
  }
  for (int u = 0; u < kVectors; ++u) store8(acc + 8 * u, round_to<T>(sums[u]));
  if (conv.silu) {
#pragma omp simd
    for (int64_t c = 0; c < kChannelBlock; ++c) acc[c] = acc[c] / (1.f + exp_poly(-acc[c]));
  }
}

// The block's taps and bias into the scratch, zero past the last channel (kept while a
// thread's consecutive items share the block: they are numbered block first).
template <typename T>
void conv_load_taps(const Conv<T>& conv, int64_t c0, int64_t count, ConvScratch& scratch) {
  std::fill_n(scratch.taps, conv.width * kChannelBlock, 0.f);
  std::fill_n(scratch.bias, kChannelBlock, 0.f);
  for (int64_t c = 0; c < count; ++c) {
    const T* taps = conv.weight + (c0 + c) * conv.weight_stride;
    for (int64_t j = 0; j < conv.width; ++j) scratch.taps[j * kChannelBlock + c] = widen(taps[j]);
    if (conv.bias != nullptr) scratch.bias[c] = widen(conv.bias[c0 + c]);
  }
}

// One item: ring row p % K holds column p of ext (the window, or zeros without a state, then
// the rows; see causal_conv1d.py); the slot ends with ext's last K-1 columns.
template <typename T>
void conv_block(const Conv<T>& conv, const Batch& batch, int64_t sequence, int64_t c0, ConvScratch& scratch) {
  const int64_t width = conv.width, count = std::min(kChannelBlock, conv.channels - c0);
  const int64_t* stride = conv.state_stride;
  T* window = conv.state + batch.slots[sequence] * stride[0] + c0 * stride[1];
  std::fill_n(scratch.ring, width * kChannelBlock, 0.f);
  if (batch.has_state[sequence])
    for (int64_t j = 0; j + 1 < width; ++j)
      for (int64_t c = 0; c < count; ++c)
        scratch.ring[j * kChannelBlock + c] = widen(window[c * stride[1] + j * stride[2]]);
  const int64_t start = batch.starts[sequence], rows = batch.rows(sequence);
  alignas(64) float acc[kChannelBlock];
  int64_t oldest = 0;  // the ring row of ext[i]; ext[i + K - 1] is the one before it
  for (int64_t i = 0; i < rows; ++i, oldest = oldest + 1 == width ? 0 : oldest + 1) {
    float* newest = scratch.ring + (oldest == 0 ? width - 1 : oldest - 1) * kChannelBlock;
    widen_row(conv.x + (start + i) * conv.x_stride + c0, count, newest);
    conv_row(conv, scratch, oldest, acc);
    store_row(acc, count, conv.out + (start + i) * conv.channels + c0);
  }
  for (int64_t j = 0, at = oldest; j + 1 < width; ++j, at = at + 1 == width ? 0 : at + 1) {
    const float* column = scratch.ring + at * kChannelBlock;  // copies of inputs: exact in T
    for (int64_t c = 0; c < count; ++c) store(column[c], window + c * stride[1] + j * stride[2]);
  }
}

at::Tensor causal_conv1d_state(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               at::Tensor& conv_state, const at::Tensor& query_start, const at::Tensor& slots,
                               const at::Tensor& has_state, std::optional<c10::string_view> activation) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x: [T, C] on the CPU, channels contiguous");
  const int64_t channels = x.size(1), width = weight.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == channels && width >= 1 && weight.stride(1) == 1 &&
                  weight.scalar_type() == x.scalar_type(),
              "weight: [C, K] in x's dtype, taps contiguous");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == channels && bias->stride(0) == 1 &&
                                     bias->scalar_type() == x.scalar_type()),
              "bias: [C] in x's dtype");
  TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == channels && conv_state.size(2) == width - 1 &&
                  conv_state.scalar_type() == x.scalar_type(),
              "conv_state: [S, C, K-1] in x's dtype");
  const bool silu = activation.has_value() && *activation == "silu";
  TORCH_CHECK(!activation.has_value() || silu, "activation: silu or None");
  const Batch batch = read_batch(query_start, slots, has_state, x.size(0), conv_state.size(0));
  at::Tensor out = at::empty({x.size(0), channels}, x.options());
  zero_outside(out, batch);
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    const Conv<T> conv{x.data_ptr<T>(), x.stride(0), weight.data_ptr<T>(), weight.stride(0),
                       bias.has_value() ? bias->data_ptr<T>() : nullptr, conv_state.data_ptr<T>(),
                       {conv_state.stride(0), conv_state.stride(1), conv_state.stride(2)}, out.data_ptr<T>(), channels,
                       width, silu};
    const int64_t blocks = (channels + kChannelBlock - 1) / kChannelBlock, count = blocks * batch.size();
    for_items(count, total_rows(batch) * channels * width, [&](int64_t begin, int64_t end) {
      ConvScratch scratch(width);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t c0 = (item / batch.size()) * kChannelBlock;
        if (item == begin || item % batch.size() == 0)
          conv_load_taps(conv, c0, std::min(kChannelBlock, channels - c0), scratch);
        conv_block(conv, batch, item % batch.size(), c0, scratch);
      }
    });
  });
  return out;
}

// ---- gated_delta_rule_state

// q and k of rows [first, end) as float32 [T, Hk, Dk], l2-normalised if asked, q divided by
// sqrt(Dk): once per row and key head, for every value head it serves.
template <typename T>
void normalise(const at::Tensor& source, bool l2norm, float divisor, int64_t first, int64_t end, float* target) {
  const int64_t heads = source.size(1), dim = source.size(2);
  const T* base = source.data_ptr<T>();
  const int64_t stride_token = source.stride(0), stride_head = source.stride(1);
  for_items((end - first) * heads, (end - first) * heads * dim, [&](int64_t begin, int64_t stop) {
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t row = first + item / heads, head = item % heads;
      const T* v = base + row * stride_token + head * stride_head;
      float* out = target + (row * heads + head) * dim;
      widen_row(v, dim, out);
      const float inverse = l2norm ? 1.f / std::sqrt(sum_of_squares(out, dim) + kL2NormEps) : 1.f;
      for (int64_t i = 0; i < dim; ++i) out[i] = (l2norm ? out[i] * inverse : out[i]) / divisor;
    }
  });
}

template <typename V>
struct DeltaRule {
  const float* q;  // [T, Hk, Dk], from `normalise`
  const float* k;
  const V* value;
  int64_t value_stride[2];  // token, head
  const float* g;
  int64_t g_stride;
  const float* beta;  // [T, Hv] float32, contiguous
  float* state;
  int64_t state_stride[3];  // slot, head, key dim (the value dim contiguous)
  V* out;                   // [T, Hv, Dv]
  int64_t key_heads, heads, key_dim, value_dim;
};

// One row on a tile of 8 kVectors columns of a head's state, S [Dk, 8 kVectors] packed, in
// place, with delta = (v - kv_mem) beta:
//   pass 1: kv_mem = sum_k (S * decay) k       pass 2: S = S * decay + k delta^T, o = sum_k S q
template <int kVectors>
inline void delta_rule_row(float* tile, int64_t key_dim, const float* q, const float* k, const Vec8* v, float decay,
                           float beta, Vec8* o) {
  constexpr int kWidth = 8 * kVectors;
  const Vec8 decays = splat8(decay), betas = splat8(beta);
  Vec8 kv_mem[kVectors] = {};
  for (int64_t i = 0; i < key_dim; ++i) {
    const float* s = tile + i * kWidth;
    const Vec8 key = splat8(k[i]);
    for (int u = 0; u < kVectors; ++u) kv_mem[u] = (load8(s + 8 * u) * decays) * key + kv_mem[u];
  }
  Vec8 delta[kVectors];
  for (int u = 0; u < kVectors; ++u) {
    delta[u] = (v[u] - kv_mem[u]) * betas;
    o[u] = Vec8{};
  }
  for (int64_t i = 0; i < key_dim; ++i) {
    float* s = tile + i * kWidth;
    const Vec8 key = splat8(k[i]), query = splat8(q[i]);
    for (int u = 0; u < kVectors; ++u) {
      const Vec8 updated = key * delta[u] + load8(s + 8 * u) * decays;
      store8(s + 8 * u, updated);
      o[u] = updated * query + o[u];
    }
  }
}

// Columns [0, width) of a row as kVectors vectors, zero past width; and back. (A loop of
// float copies would become a memcpy call or a rep movs per row.)
template <int kVectors, typename T>
inline void load_columns(const T* source, int64_t width, Vec8* target) {
  for (int u = 0; u < kVectors; ++u) {
    if (8 * u + 8 <= width) {
      target[u] = widen8(source + 8 * u);
    } else {
      float part[8] = {};
      for (int64_t c = 8 * u; c < width; ++c) part[c - 8 * u] = widen(source[c]);
      target[u] = load8(part);
    }
  }
}
template <int kVectors, typename T>
inline void store_columns(const Vec8* source, int64_t width, T* target) {
  for (int u = 0; u < kVectors; ++u) {
    if (8 * u + 8 <= width) {
      store8(target + 8 * u, source[u]);
    } else {
      float part[8];
      store8(part, source[u]);
      for (int64_t c = 8 * u; c < width; ++c) store(part[c - 8 * u], target + c);
    }
  }
}

// Columns [c0, c0 + width) of one head's state over all of the sequence's rows, in `tile`
// meanwhile: packed, it stays in L1 (the state's own rows, Dv apart, collide in its sets),
// and padded with zero columns to 8 kVectors (their v is 0, so they stay 0). A column's
// arithmetic is the same in any tile.
template <int kVectors, typename V>
void delta_rule_columns(const DeltaRule<V>& rule, float* state, int64_t start, int64_t rows, int64_t head,
                        int64_t c0, int64_t width, float* tile) {
  constexpr int kWidth = 8 * kVectors;
  const int64_t key_head = head / (rule.heads / rule.key_heads), stride = rule.state_stride[2];
  std::fill_n(tile, rule.key_dim * kWidth, 0.f);
  for (int64_t i = 0; i < rule.key_dim; ++i) std::copy_n(state + i * stride + c0, width, tile + i * kWidth);
  Vec8 v[kVectors], o[kVectors];
  for (int64_t row = start; row < start + rows; ++row) {
    load_columns<kVectors>(rule.value + row * rule.value_stride[0] + head * rule.value_stride[1] + c0, width, v);
    const int64_t vector = (row * rule.key_heads + key_head) * rule.key_dim;
    const float decay = std::exp(rule.g[row * rule.g_stride + head]), beta = rule.beta[row * rule.heads + head];
    delta_rule_row<kVectors>(tile, rule.key_dim, rule.q + vector, rule.k + vector, v, decay, beta, o);
    store_columns<kVectors>(o, width, rule.out + (row * rule.heads + head) * rule.value_dim + c0);
  }
  for (int64_t i = 0; i < rule.key_dim; ++i) std::copy_n(tile + i * kWidth, width, state + i * stride + c0);
}

// One item, a tile of kColumnTile columns at a time; tile: [Dk, kColumnTile] floats of scratch.
template <typename V>
void delta_rule_head(const DeltaRule<V>& rule, const Batch& batch, int64_t sequence, int64_t head, float* tile) {
  float* state = rule.state + batch.slots[sequence] * rule.state_stride[0] + head * rule.state_stride[1];
  if (!batch.has_state[sequence])
    for (int64_t i = 0; i < rule.key_dim; ++i) std::fill_n(state + i * rule.state_stride[2], rule.value_dim, 0.f);
  const int64_t start = batch.starts[sequence], rows = batch.rows(sequence);
  for (int64_t c0 = 0; c0 < rule.value_dim; c0 += kColumnTile) {
    const int64_t width = std::min<int64_t>(kColumnTile, rule.value_dim - c0);
    switch ((width + 7) / 8) {
      case 1: delta_rule_columns<1>(rule, state, start, rows, head, c0, width, tile); break;
      case 2: delta_rule_columns<2>(rule, state, start, rows, head, c0, width, tile); break;
      case 3: delta_rule_columns<3>(rule, state, start, rows, head, c0, width, tile); break;
      default: delta_rule_columns<4>(rule, state, start, rows, head, c0, width, tile);
    }
  }
}

at::Tensor gated_delta_rule_state(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                  const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                  const at::Tensor& query_start, const at::Tensor& slots, const at::Tensor& has_state,
                                  bool use_qk_l2norm) {
  TORCH_CHECK(query.device().is_cpu() && query.dim() == 3 && key.sizes() == query.sizes() && query.stride(2) == 1 &&
                  key.stride(2) == 1 && key.scalar_type() == query.scalar_type(),
              "query, key: [T, Hk, Dk] alike on the CPU, last dim contiguous");
  const int64_t tokens = query.size(0), key_heads = query.size(1), key_dim = query.size(2);
  TORCH_CHECK(value.dim() == 3 && value.size(0) == tokens && value.stride(2) == 1 && key_heads > 0 &&
                  value.size(1) % key_heads == 0 && value.scalar_type() == query.scalar_type(),
              "value: [T, Hv, Dv] in query's dtype, Hv a multiple of Hk");
  const int64_t heads = value.size(1), value_dim = value.size(2);
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.dim() == 2 && g.size(0) == tokens && g.size(1) == heads &&
                  g.stride(1) == 1 && beta.dim() == 2 && beta.size(0) == tokens && beta.size(1) == heads,
              "g: [T, Hv] float32, beta: [T, Hv]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.size(1) == heads &&
                  state.size(2) == key_dim && state.size(3) == value_dim && state.stride(3) == 1,
              "state: [S, Hv, Dk, Dv] float32, Dv contiguous");
  const Batch batch = read_batch(query_start, slots, has_state, tokens, state.size(0));
  const at::Tensor q = at::empty({tokens, key_heads, key_dim}, query.options().dtype(at::kFloat));
  const at::Tensor k = at::empty_like(q), beta_float = beta.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({tokens, heads, value_dim}, value.options());
  zero_outside(out, batch);
  const float divisor = static_cast<float>(std::sqrt(static_cast<double>(key_dim)));
  dispatch_float(value, [&](auto tag) {
    using V = decltype(tag);
    normalise<V>(query, use_qk_l2norm, divisor, batch.starts.front(), batch.starts.back(), q.data_ptr<float>());
    normalise<V>(key, use_qk_l2norm, 1.f, batch.starts.front(), batch.starts.back(), k.data_ptr<float>());
    const DeltaRule<V> rule{q.data_ptr<float>(), k.data_ptr<float>(), value.data_ptr<V>(),
                            {value.stride(0), value.stride(1)}, g.data_ptr<float>(), g.stride(0),
                            beta_float.data_ptr<float>(), state.data_ptr<float>(),
                            {state.stride(0), state.stride(1), state.stride(2)}, out.data_ptr<V>(), key_heads, heads,
                            key_dim, value_dim};
    const int64_t count = heads * batch.size();
    for_items(count, total_rows(batch) * heads * key_dim * value_dim, [&](int64_t begin, int64_t end) {
      AlignedFloats tile(key_dim * kColumnTile);
      for (int64_t item = begin; item < end; ++item)
        delta_rule_head(rule, batch, item % batch.size(), item / batch.size(), tile.data());
    });
  });
  return out;
}

// ---- selective_scan_state

template <typename T>
struct Scan {
  const T* x;
  int64_t x_stride[2];  // token, head
  const T* dt;
  int64_t dt_stride;
  const T* B;
  const T* C;
  int64_t B_stride[2], C_stride[2];  // token, group
  const float* A;
  const float* D;
  const float* dt_bias;  // rounded to T, as dt_bias.to(dt.dtype)
  float* state;
  int64_t state_stride[3];  // slot, head, head dim (N contiguous)
  T* out;                   // [T, H, P]
  int64_t heads, groups, head_dim, state_size;
  float dt_low, dt_high;  // rounded to T, as torch.clamp rounds its bounds
  bool skip_rounded;      // D * x in x's dtype (torch's promotion of x and D gives x's)
};

// dt of one row and head: softplus(dt + dt_bias), clamped, rounded to T where torch rounds.
template <typename T>
inline float time_step(const Scan<T>& scan, int64_t row, int64_t head) {
  const float dt = round_to<T>(widen(scan.dt[row * scan.dt_stride + head]) + scan.dt_bias[head]);
  const float softplus = round_to<T>(dt > kSoftplusThreshold ? dt : std::log1p(std::exp(dt)));
  return std::min(std::max(softplus, scan.dt_low), scan.dt_high);
}

// 8 elements of one state row: S = S * decay + round(db * x_p); returns sums + round(S) * C.
template <typename T>
inline Vec8 scan_step(float* s, const float* db, const float* c, Vec8 decay, Vec8 x_p, Vec8 sums) {
  const Vec8 updated = load8(s) * decay + round_to<T>(load8(db) * x_p);
  store8(s, updated);
  return round_to<T>(updated) * load8(c) + sums;
}

// One state row p of one row t: S = S * exp(dt A) + (dt B) x_p, y_p = round(S) . C + D x_p;
// the sum over N in one fixed order for a given N (4 vectors of partial sums, then the rest).
template <typename T>
inline float scan_state_row(float* s, const float* db, const float* c, int64_t state_size, float decay, float x_p,
                            float D, bool skip_rounded) {
  const Vec8 decays = splat8(decay), xs = splat8(x_p);
  Vec8 sums[4] = {};
  int64_t n = 0;
  for (; n + 32 <= state_size; n += 32)
    for (int u = 0; u < 4; ++u)
      sums[u] = scan_step<T>(s + n + 8 * u, db + n + 8 * u, c + n + 8 * u, decays, xs, sums[u]);
  for (; n + 8 <= state_size; n += 8) sums[0] = scan_step<T>(s + n, db + n, c + n, decays, xs, sums[0]);
  float tail = 0.f;
  for (; n < state_size; ++n) {
    s[n] = std::fma(s[n], decay, round_to<T>(db[n] * x_p));
    tail = std::fma(round_to<T>(s[n]), c[n], tail);
  }
  const float y = round_to<T>(sum8((sums[0] + sums[1]) + (sums[2] + sums[3])) + tail), skip = x_p * D;
  return round_to<T>(y + (skip_rounded ? round_to<T>(skip) : skip));
}

// State rows [p0, p0 + count) of one head over all of the sequence's rows.
template <typename T>
void scan_rows(const Scan<T>& scan, float* state, int64_t start, int64_t rows, int64_t head, int64_t p0,
               int64_t count, float* db, float* c) {
  const int64_t group = head / (scan.heads / scan.groups), n = scan.state_size;
  for (int64_t row = start; row < start + rows; ++row) {
    const float dt = time_step(scan, row, head), decay = std::exp(dt * scan.A[head]);
    const T* b_row = scan.B + row * scan.B_stride[0] + group * scan.B_stride[1];
    const T* c_row = scan.C + row * scan.C_stride[0] + group * scan.C_stride[1];
    for (int64_t i = 0; i < n; ++i) {
      db[i] = round_to<T>(dt * widen(b_row[i]));
      c[i] = widen(c_row[i]);
    }
    const T* x = scan.x + row * scan.x_stride[0] + head * scan.x_stride[1];
    T* target = scan.out + (row * scan.heads + head) * scan.head_dim;
    for (int64_t p = p0; p < p0 + count; ++p) {
      const float y = scan_state_row<T>(state + p * scan.state_stride[2], db, c, n, decay, widen(x[p]),
                                        scan.D[head], scan.skip_rounded);
      store(y, target + p);
    }
  }
}

template <typename T>
void scan_head(const Scan<T>& scan, const Batch& batch, int64_t sequence, int64_t head, float* db, float* c) {
  float* state = scan.state + batch.slots[sequence] * scan.state_stride[0] + head * scan.state_stride[1];
  if (!batch.has_state[sequence])
    for (int64_t p = 0; p < scan.head_dim; ++p) std::fill_n(state + p * scan.state_stride[2], scan.state_size, 0.f);
  for (int64_t p0 = 0; p0 < scan.head_dim; p0 += kRowTile)
    scan_rows(scan, state, batch.starts[sequence], batch.rows(sequence), head, p0,
              std::min(kRowTile, scan.head_dim - p0), db, c);
}

void check_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias, const at::Tensor& state,
                c10::ArrayRef<double> dt_limit) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "x: [T, H, P] on the CPU, P contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1);
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == tokens && dt.size(1) == heads && dt.stride(1) == 1 &&
                  dt.scalar_type() == x.scalar_type(),
              "dt: [T, H] in x's dtype");
  TORCH_CHECK(B.dim() == 3 && B.size(0) == tokens && B.size(1) > 0 && heads % B.size(1) == 0 && B.stride(2) == 1 &&
                  C.sizes() == B.sizes() && C.stride(2) == 1 && B.scalar_type() == x.scalar_type() &&
                  C.scalar_type() == x.scalar_type(),
              "B, C: [T, G, N] in x's dtype, G dividing H");
  TORCH_CHECK(A.scalar_type() == at::kFloat && A.numel() == heads && D.numel() == heads && dt_bias.numel() == heads,
              "A [H] float32, D and dt_bias [H]");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.size(1) == heads &&
                  state.size(2) == x.size(2) && state.size(3) == B.size(2) && state.stride(3) == 1,
              "state: [S, H, P, N] float32, N contiguous");
  TORCH_CHECK(dt_limit.size() == 2 && dt_limit[0] <= dt_limit[1], "dt_limit: (low, high)");
}

at::Tensor selective_scan_state(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                                const at::Tensor& C, const at::Tensor& D, const at::Tensor& dt_bias, at::Tensor& state,
                                const at::Tensor& query_start, const at::Tensor& slots, const at::Tensor& has_state,
                                c10::ArrayRef<double> dt_limit) {
  check_scan(x, dt, A, B, C, D, dt_bias, state, dt_limit);
  const Batch batch = read_batch(query_start, slots, has_state, x.size(0), state.size(0));
  const at::Tensor A_float = A.contiguous(), D_float = D.to(at::kFloat).contiguous();
  const at::Tensor bias = dt_bias.to(x.scalar_type()).to(at::kFloat).contiguous();
  const bool skip_rounded = at::promote_types(x.scalar_type(), D.scalar_type()) == x.scalar_type();
  at::Tensor out = at::empty(x.sizes(), x.options());
  zero_outside(out, batch);
  const int64_t heads = x.size(1), head_dim = x.size(2), state_size = B.size(2);
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    const float low = round_to<T>(static_cast<float>(dt_limit[0])), high = round_to<T>(static_cast<float>(dt_limit[1]));
    const Scan<T> scan{x.data_ptr<T>(), {x.stride(0), x.stride(1)}, dt.data_ptr<T>(), dt.stride(0), B.data_ptr<T>(),
                       C.data_ptr<T>(), {B.stride(0), B.stride(1)}, {C.stride(0), C.stride(1)},
                       A_float.data_ptr<float>(), D_float.data_ptr<float>(), bias.data_ptr<float>(),
                       state.data_ptr<float>(), {state.stride(0), state.stride(1), state.stride(2)}, out.data_ptr<T>(),
                       heads, B.size(1), head_dim, state_size, low, high, skip_rounded};
    const int64_t count = heads * batch.size();
    for_items(count, total_rows(batch) * heads * head_dim * state_size, [&](int64_t begin, int64_t end) {
      AlignedFloats db(state_size), c(state_size);
      for (int64_t item = begin; item < end; ++item)
        scan_head(scan, batch, item % batch.size(), item / batch.size(), db.data(), c.data());
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def(
      "causal_conv1d_state(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, Tensor query_start, "
      "Tensor slots, Tensor has_state, str? activation) -> Tensor");
  m.def(
      "gated_delta_rule_state(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta, Tensor(a!) state, "
      "Tensor query_start, Tensor slots, Tensor has_state, bool use_qk_l2norm) -> Tensor");
  m.def(
      "selective_scan_state(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor dt_bias, "
      "Tensor(a!) state, Tensor query_start, Tensor slots, Tensor has_state, float[] dt_limit) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) {
  m.impl("causal_conv1d_state", &causal_conv1d_state);
  m.impl("gated_delta_rule_state", &gated_delta_rule_state);
  m.impl("selective_scan_state", &selective_scan_state);
}
