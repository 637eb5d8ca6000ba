// Fused elementwise ops for the CPU decode step, float32: RMSNorm with the residual add, and the
// rotary embedding. In torch each is 5-8 small ops of ~10 us at decode batch sizes; here one
// pass. Same arithmetic as the torch versions (norm statistics in float32, rotate-half layout),
// only the summation order of the norm's mean differs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

constexpr int64_t kGrainElements = 32768;  // below this much work, one thread (no fork/join)

int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a CPU float32 tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with contiguous rows");
}

}  // namespace

// x, residual: [T, H] (rows contiguous); weight [H]. Returns (weight * norm(x + residual), x + residual).
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be [hidden] float32");
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must be shaped like x");
  }
  at::Tensor summed = has_residual ? at::empty({rows, hidden}, x.options()) : x;
  at::Tensor out = at::empty({rows, hidden}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = has_residual ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* sp = summed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = has_residual ? residual->stride(0) : 0, ss = summed.stride(0);
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * xs;
      float* sr = sp + r * ss;
      float sumsq = 0.0f;
      if (has_residual) {
        const float* rr = rp + r * rs;
#pragma omp simd reduction(+ : sumsq)
        for (int64_t d = 0; d < hidden; ++d) {
          const float v = xr[d] + rr[d];
          sr[d] = v;
          sumsq += v * v;
        }
      } else {
#pragma omp simd reduction(+ : sumsq)
        for (int64_t d = 0; d < hidden; ++d) sumsq += xr[d] * xr[d];
      }
      const float inv = 1.0f / std::sqrt(sumsq / static_cast<float>(hidden) + feps);
      float* orow = op + r * hidden;
#pragma omp simd
      for (int64_t d = 0; d < hidden; ++d) orow[d] = wp[d] * (sr[d] * inv);
    }
  });
  return {out, summed};
}

// x: [T, heads, D] (any row stride, heads and elements contiguous); cos, sin: [T, 1, D] or [T, D]
// contiguous. Returns x * cos + rotate_half(x) * sin, contiguous [T, heads, D].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3, "x must be [T, heads, D] CPU float32");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == dim && dim % 2 == 0, "x must have contiguous heads of even size");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "cos, sin must be contiguous float32");
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim, "cos, sin must hold [T, D]");
  at::Tensor out = at::empty({rows, heads, dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * dim;
      const float* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xr = xp + t * xs + h * dim;
        float* o = op + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          o[d] = xr[d] * c[d] + (-xr[d + half]) * s[d];
          o[d + half] = xr[d + half] * c[d + half] + xr[d] * s[d + half];
        }
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(disagg_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(disagg_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
}
