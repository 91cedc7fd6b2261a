// bfloat16 matmuls on AMX tiles over weights packed at load (kernels/amx_tiles.py,
// cpu_experts_amx.h `multiply_packed`):
//
//   amx_tiles_fit(size, outputs) -> bool     whether [outputs, size] weights run on the tiles here
//   tiles_linear(x [R, K], w packed [N, K], out [R, N] float32)
//       out = (x @ w.T) rounded to bfloat16 (as F.linear in bfloat16), as float32
//
// The vocabulary head's decode step reads its whole weight once per step: 311 MB for
// Qwen3's 151,936 tokens. oneDNN streamed it at about 17 GB/s here (18 ms at 64 rows), the
// tiles at the bandwidth the experts reach; each logit is one chain over k in order, so a
// row's logits are the same alone or in any batch (oneDNN picks kernels by the row count).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_experts_amx.h"
#include "cpu_vec.h"

namespace {

using BFloat16 = c10::BFloat16;
using namespace pagefleet;


bool amx_tiles_fit(int64_t size, int64_t outputs) { return experts_amx::packed_fits(size, outputs); }

void tiles_linear(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "x, weight: bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "x [R, K], weight [N, K]: contiguous");
  const int64_t rows = x.size(0), size = x.size(1), outputs = weight.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == at::IntArrayRef({rows, outputs}),
              "out: [R, N] float32, contiguous");
  TORCH_CHECK(amx_tiles_fit(size, outputs), "tiles_linear: an AMX CPU and whole tiles (K and N multiples of 32)");
#if defined(__AVX512F__)
  // Tiles read 16 rows at a time: the rows padded to a multiple of 16.
  const int64_t padded_rows = (rows + 15) / 16 * 16;
  at::Tensor padded = padded_rows == rows ? x : at::zeros({padded_rows, size}, x.options());
  if (padded_rows != rows) padded.narrow(0, 0, rows).copy_(x);
  const BFloat16 *rows_in = padded.data_ptr<BFloat16>(), *w = weight.data_ptr<BFloat16>();
  float* target = out.data_ptr<float>();
  constexpr BFloat16* tag = nullptr;
  at::parallel_for(0, outputs / 32, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> staging(32 * 32);
    const auto keep = [&](int64_t first, int64_t tokens, int64_t j, const float* sums) {
      for (int64_t r = 0; r < tokens; ++r, sums += 32)
        for (int64_t h = 0; h < 32; h += 16)
          _mm512_storeu_ps(target + (first + r) * outputs + j * 32 + h, round_as(tag, _mm512_loadu_ps(sums + h)));
    };
    experts_amx::multiply_packed(rows_in, rows, size, w, b0, b1, 2, 1, staging.data(), keep, true);
  });
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagefleet, m) {
  m.def("amx_tiles_fit(int size, int outputs) -> bool", &amx_tiles_fit);
  m.def("tiles_linear(Tensor x, Tensor weight, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagefleet, CPU, m) { m.impl("tiles_linear", &tiles_linear); }
