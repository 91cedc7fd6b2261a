// The flat batch of sequences with state slots and the arithmetic helpers (8-float vectors,
// bfloat16 rounding by the bits) of the state layers' recurrences (cpu_state.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

using namespace pagefleet;

// Element updates below which a call runs on the calling thread: waking the pool's other
// threads (they sleep, with OMP_WAIT_POLICY=PASSIVE) costs more than a small decode step.
constexpr int64_t kSerialWork = 1 << 17;
constexpr int64_t kChannelBlock = 64;  // conv channels per item: 8 AVX2 vectors
constexpr int kColumnTile = 32;        // delta-rule state columns walked together (4 Vec8): 16 KB for Dk 128
constexpr int64_t kRowTile = 16;       // scan state rows walked together: 8 KB for N 128
constexpr float kSoftplusThreshold = 20.f;  // F.softplus's: above it, softplus(x) is x
constexpr float kL2NormEps = 1e-6f;        // transformers' l2norm

// One range of items, on the calling thread when the whole call is small.
template <typename F>
void for_items(int64_t count, int64_t work, const F& body) {
  at::parallel_for(0, count, work < kSerialWork ? std::max<int64_t>(count, 1) : 1, body);
}

// ---- The flat batch.

struct Batch {
  std::vector<int64_t> starts;  // N + 1 row offsets
  std::vector<int64_t> slots;
  std::vector<uint8_t> has_state;
  int64_t size() const { return static_cast<int64_t>(slots.size()); }
  int64_t rows(int64_t sequence) const { return starts[sequence + 1] - starts[sequence]; }
};

// Checked here, where a wrong slot would be a write out of bounds (the references index).
Batch read_batch(const at::Tensor& query_start, const at::Tensor& slots, const at::Tensor& has_state,
                 int64_t num_tokens, int64_t num_slots) {
  const int64_t count = slots.numel();
  TORCH_CHECK(query_start.numel() == count + 1 && has_state.numel() == count && has_state.scalar_type() == at::kBool,
              "query_start [N + 1], slots [N], has_state [N] bool");
  const at::Tensor starts = query_start.to(at::kLong).contiguous(), indices = slots.to(at::kLong).contiguous();
  const at::Tensor flags = has_state.contiguous();
  Batch batch{std::vector<int64_t>(starts.data_ptr<int64_t>(), starts.data_ptr<int64_t>() + count + 1),
              std::vector<int64_t>(indices.data_ptr<int64_t>(), indices.data_ptr<int64_t>() + count),
              std::vector<uint8_t>(flags.data_ptr<bool>(), flags.data_ptr<bool>() + count)};
  TORCH_CHECK(batch.starts[0] >= 0 && batch.starts[count] <= num_tokens, "query_start: rows out of range");
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(batch.starts[i] <= batch.starts[i + 1], "query_start: decreasing");
    TORCH_CHECK(batch.slots[i] >= 0 && batch.slots[i] < num_slots, "slots: ", batch.slots[i], " out of range");
  }
  return batch;
}

int64_t total_rows(const Batch& batch) { return batch.starts.back() - batch.starts.front(); }

// Rows before the first sequence and after the last get zeros, as the references give them.
void zero_outside(at::Tensor& out, const Batch& batch) {
  const int64_t first = batch.starts.front(), end = batch.starts.back();
  if (first > 0) out.narrow(0, 0, first).zero_();
  if (end < out.size(0)) out.narrow(0, end, out.size(0) - end).zero_();
}

// Scratch floats starting on a 64-byte boundary (malloc gives 16), so that no vector load or
// store of a packed tile straddles two cache lines.
class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t count) : storage_(count + 16, 0.f) {}
  float* data() {
    const auto address = reinterpret_cast<uintptr_t>(storage_.data());
    return reinterpret_cast<float*>((address + 63) & ~uintptr_t{63});
  }

 private:
  std::vector<float> storage_;
};

// ---- Arithmetic helpers. Vec8 is 8 floats as one value (GCC's vector extension: a ymm
// register under AVX2, split on narrower builds): the loops over a state's columns keep their
// accumulators in registers, which the auto-vectoriser does not (it unrolls and jams the loop
// over Dk around them). A multiply-add is written a * b + c, fused by -ffp-contract=fast.

typedef float Vec8 __attribute__((vector_size(32)));
typedef uint32_t Bits8 __attribute__((vector_size(32)));
typedef uint16_t Half8 __attribute__((vector_size(16)));

inline Vec8 load8(const float* source) {
  Vec8 value;
  std::memcpy(&value, source, sizeof(value));
  return value;
}
inline void store8(float* target, Vec8 value) { std::memcpy(target, &value, sizeof(value)); }
inline Vec8 splat8(float value) { return Vec8{value, value, value, value, value, value, value, value}; }
inline float sum8(Vec8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

// To the nearest bfloat16, ties to even, by the bits (inputs are finite).
inline float round_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
inline Vec8 round_bf16(Vec8 value) {
  Bits8 bits = (Bits8)value;  // a cast between vectors of one size keeps the bits
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return (Vec8)bits;
}

// value as type T holds it (float: itself; bfloat16: rounded), as float32.
template <typename T, typename F>
inline F round_to(F value) {
  if constexpr (std::is_same_v<T, float>) return value;
  else return round_bf16(value);
}

inline void store(float value, float* target) { *target = value; }
inline void store(float value, c10::BFloat16* target) {
  uint32_t bits;
  const float rounded = round_bf16(value);
  std::memcpy(&bits, &rounded, sizeof(bits));
  target->x = static_cast<uint16_t>(bits >> 16);
}

inline Vec8 widen8(const float* source) { return load8(source); }
inline Vec8 widen8(const c10::BFloat16* source) {
  Half8 halves;
  std::memcpy(&halves, source, sizeof(halves));
  return (Vec8)(__builtin_convertvector(halves, Bits8) << 16);
}
inline void store8(c10::BFloat16* target, Vec8 value) {
  const Half8 halves = __builtin_convertvector((Bits8)round_bf16(value) >> 16, Half8);
  std::memcpy(target, &halves, sizeof(halves));
}

// A row of `count` elements to float32 and back, 8 at a time: a loop of copies would become
// a memcpy call (or rep movs) per row.
template <typename T>
inline void widen_row(const T* source, int64_t count, float* target) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) store8(target + i, widen8(source + i));
  for (; i < count; ++i) target[i] = widen(source[i]);
}
template <typename T>
inline void store_row(const float* source, int64_t count, T* target) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) store8(target + i, load8(source + i));
  for (; i < count; ++i) store(source[i], target + i);
}

// exp by Cephes' expf (exp8/exp16's polynomial), within 2 ulp on [-87.3, 88.3], inputs
// clamped to that range (silu needs no exact 0 below it). No branch: its loop vectorises.
inline float exp_poly(float x) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  x = std::max(std::min(x, 88.3762626647949f), -87.3365447505531f);
  const float n = std::fma(x, 1.44269504088896341f, kMagic) - kMagic;
  x = std::fma(-n, 0.693359375f, x);
  x = std::fma(-n, -2.12194440e-4f, x);
  float y = 1.9875691500E-4f;
  y = std::fma(y, x, 1.3981999507E-3f);
  y = std::fma(y, x, 8.3334519073E-3f);
  y = std::fma(y, x, 4.1665795894E-2f);
  y = std::fma(y, x, 1.6666665459E-1f);
  y = std::fma(y, x, 5.0000001201E-1f);
  y = std::fma(y, x * x, x + 1.f);
  const uint32_t exponent = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent, sizeof(scale));
  return y * scale;
}

// sum of v[i]^2 in one fixed order for a given size: 4 vectors of partial sums, then the rest.
inline float sum_of_squares(const float* v, int64_t size) {
  Vec8 sums[4] = {};
  int64_t i = 0;
  for (; i + 32 <= size; i += 32)
    for (int u = 0; u < 4; ++u) sums[u] = load8(v + i + 8 * u) * load8(v + i + 8 * u) + sums[u];
  float tail = 0.f;
  for (; i < size; ++i) tail = std::fma(v[i], v[i], tail);
  return sum8((sums[0] + sums[1]) + (sums[2] + sums[3])) + tail;
}

}  // namespace
