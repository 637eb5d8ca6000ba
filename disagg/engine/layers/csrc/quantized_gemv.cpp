// Products of a few activation rows with weights kept in 4- or 8-bit blocks, for the CPU decode
// step. A decode step of a few requests reads every weight once and does little else with it,
// so this is done the way llama.cpp does it: the activation rows are quantized to int8 in blocks
// of 32 (one scale each), and each block's dot product is taken in integers (AVX-512 VNNI, AVX2,
// or plain C++ elsewhere) and scaled once. It takes float32 rows and gives float32 rows, so a
// step converts nothing around it (torch's weight-only kernels want bfloat16).
//
// Weights:
// - q4 blocks: [out, in / 32] blocks of 20 bytes, GGUF's Q4_1 layout: float16 scale d, float16
//   offset m, 16 bytes of nibbles; weight j of the block is d * q_j + m, with q_j the low nibble
//   of byte j for j < 16 and the high nibble of byte j - 16 after. (Q4_0 is m = -8 d.)
// - q8 blocks: int8 [out, in] with a float32 scale per 32 weights (GGUF's Q8_0 values), as the
//   tied token embedding keeps them (disagg.engine.models.llama.QuantizedEmbedding).
// The activations' int8 rounding is the one llama.cpp's own CPU path makes (its Q8_0/Q8_1 rows).
// q8_gemv_exact takes the rows as they are (float32 products with the int8 weights): for the
// logits a prompt's first token is sampled from, which are then the reference's own.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4BlockBytes = 20;
constexpr int64_t kMaxRows = 8;      // activation rows computed together (each weight loaded once)
constexpr int64_t kChunkRows = 64;   // output rows a thread takes at a time

struct Q4Block {
  uint16_t d, m;  // float16 bits
  uint8_t qs[16];
};
static_assert(sizeof(Q4Block) == kQ4BlockBytes, "a q4 block is 20 bytes");

inline float half_to_float(uint16_t bits) {
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  c10::Half h;
  h.x = bits;
  return static_cast<float>(h);
#endif
}

// Activation rows in int8 blocks: q[r][k]; per block its scale and scale * sum(q) (for q4's m).
struct QuantizedRows {
  int64_t rows, blocks;
  std::vector<int8_t> q;
  std::vector<float> scale, scaled_sum;
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in) {
  QuantizedRows a{rows, in / kBlock, std::vector<int8_t>(rows * in), std::vector<float>(rows * (in / kBlock)),
                  std::vector<float>(rows * (in / kBlock))};
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < a.blocks; ++b) {
      const float* v = x + r * in + b * kBlock;
      float amax = 0.0f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.0f;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = a.q.data() + r * in + b * kBlock;
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        sum += q[j];
      }
      a.scale[r * a.blocks + b] = d;
      a.scaled_sum[r * a.blocks + b] = d * static_cast<float>(sum);
    }
  }
  return a;
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 unsigned bytes times 32 signed bytes, summed in 8 int32 lanes.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline __m256i q4_unpack(const Q4Block& blk) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(packed, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low4);
  return _mm256_set_m128i(hi, lo);
}
#endif

// Dots of NC output rows (their q4 blocks at rows[c]) with NR activation rows from r0:
// out[c * NR + r]. NR and NC are compile-time, so the NC * NR accumulators stay in registers and
// form independent chains (one chain alone waits on its FMA's latency every block).
template <int NR, int NC>
void q4_tile(const Q4Block* const* rows, const QuantizedRows& a, int64_t r0, float* out) {
  const int64_t in = a.blocks * kBlock;
  float offsets[NC * NR] = {};
#if defined(__AVX2__)
  __m256 acc[NC * NR];
  for (int i = 0; i < NC * NR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m256i x[NR];
    float xs[NR], xsum[NR];
    for (int r = 0; r < NR; ++r) {
      x[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (r0 + r) * in + b * kBlock));
      xs[r] = a.scale[(r0 + r) * a.blocks + b];
      xsum[r] = a.scaled_sum[(r0 + r) * a.blocks + b];
    }
    for (int c = 0; c < NC; ++c) {
      const Q4Block& blk = rows[c][b];
      const __m256i w = q4_unpack(blk);
      const float d = half_to_float(blk.d), m = half_to_float(blk.m);
      for (int r = 0; r < NR; ++r) {
        acc[c * NR + r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs[r]), _mm256_cvtepi32_ps(dot_u8_s8(w, x[r])), acc[c * NR + r]);
        // Fused explicitly: left to the compiler, whether it fuses depends on how it vectorizes
        // each (NR, NC) tile, and a row's last bits would then depend on its batch.
        offsets[c * NR + r] = std::fma(m, xsum[r], offsets[c * NR + r]);
      }
    }
  }
  for (int i = 0; i < NC * NR; ++i) out[i] = hsum(acc[i]) + offsets[i];
#else
  float acc[NC * NR] = {};
  for (int64_t b = 0; b < a.blocks; ++b) {
    for (int c = 0; c < NC; ++c) {
      const Q4Block& blk = rows[c][b];
      const float d = half_to_float(blk.d), m = half_to_float(blk.m);
      for (int r = 0; r < NR; ++r) {
        const int64_t ar = (r0 + r) * a.blocks + b;
        const int8_t* x = a.q.data() + (r0 + r) * in + b * kBlock;
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j) dot += (blk.qs[j] & 0x0F) * x[j] + (blk.qs[j] >> 4) * x[j + 16];
        acc[c * NR + r] = std::fma(d * a.scale[ar], static_cast<float>(dot), acc[c * NR + r]);
        offsets[c * NR + r] = std::fma(m, a.scaled_sum[ar], offsets[c * NR + r]);
      }
    }
  }
  for (int i = 0; i < NC * NR; ++i) out[i] = acc[i] + offsets[i];
#endif
}

// Output rows [begin, end) of a q4 weight times activation rows r0 .. r0 + NR: calls
// emit(n, r, value) for each. Enough output rows at once that NC * NR >= 4 chains run side by side.
template <int NR, typename Emit>
void q4_span(const Q4Block* w, int64_t blocks, int64_t begin, int64_t end, const QuantizedRows& a, int64_t r0, const Emit& emit) {
  constexpr int NC = NR >= 4 ? 1 : (NR == 1 ? 4 : 2);
  float tile[NC * NR];
  int64_t n = begin;
  for (; n + NC <= end; n += NC) {
    const Q4Block* rows[NC];
    for (int c = 0; c < NC; ++c) rows[c] = w + (n + c) * blocks;
    q4_tile<NR, NC>(rows, a, r0, tile);
    for (int c = 0; c < NC; ++c)
      for (int r = 0; r < NR; ++r) emit(n + c, r, tile[c * NR + r]);
  }
  for (; n < end; ++n) {
    const Q4Block* row = w + n * blocks;
    q4_tile<NR, 1>(&row, a, r0, tile);
    for (int r = 0; r < NR; ++r) emit(n, r, tile[r]);
  }
}

// q4_span with the number of activation rows (1 .. kMaxRows) chosen at run time.
template <typename Emit>
void q4_rows(const Q4Block* w, int64_t blocks, int64_t begin, int64_t end, const QuantizedRows& a, int64_t r0, int64_t nr, const Emit& emit) {
  switch (nr) {
    case 1: return q4_span<1>(w, blocks, begin, end, a, r0, emit);
    case 2: return q4_span<2>(w, blocks, begin, end, a, r0, emit);
    case 3: return q4_span<3>(w, blocks, begin, end, a, r0, emit);
    case 4: return q4_span<4>(w, blocks, begin, end, a, r0, emit);
    case 5: return q4_span<5>(w, blocks, begin, end, a, r0, emit);
    case 6: return q4_span<6>(w, blocks, begin, end, a, r0, emit);
    case 7: return q4_span<7>(w, blocks, begin, end, a, r0, emit);
    default: return q4_span<8>(w, blocks, begin, end, a, r0, emit);
  }
}

// out[r] = row . x[r]; `q`: one output row's int8 weights, `scale` its per-block scales.
void q8_row_dots(const int8_t* q, const float* scale, const QuantizedRows& a, int64_t r0, int64_t nr, float* out) {
  const int64_t in = a.blocks * kBlock;
#if defined(__AVX2__)
  __m256 acc[kMaxRows];
  for (int64_t r = 0; r < nr; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
    const __m256i w_abs = _mm256_sign_epi8(w, w);  // |w| times x with w's sign: unsigned x signed
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t ar = (r0 + r) * a.blocks + b;
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (r0 + r) * in + b * kBlock));
      const __m256i dot = dot_u8_s8(w_abs, _mm256_sign_epi8(x, w));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(scale[b] * a.scale[ar]), _mm256_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int64_t r = 0; r < nr; ++r) out[r] = hsum(acc[r]);
#else
  for (int64_t r = 0; r < nr; ++r) {
    float acc = 0.0f;
    for (int64_t b = 0; b < a.blocks; ++b) {
      const int8_t* x = a.q.data() + (r0 + r) * in + b * kBlock;
      int32_t dot = 0;
      for (int64_t j = 0; j < kBlock; ++j) dot += q[b * kBlock + j] * x[j];
      acc += scale[b] * a.scale[(r0 + r) * a.blocks + b] * static_cast<float>(dot);
    }
    out[r] = acc;
  }
#endif
}

// out[r] = row . x[r] in float32, x not rounded: `q` one output row's int8 weights, `scale` its
// per-block scales, x the rows r0 .. r0 + nr of `in` floats each.
void q8_row_dots_exact(const int8_t* q, const float* scale, const float* x, int64_t in, int64_t nr, float* out) {
  const int64_t blocks = in / kBlock;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc[kMaxRows];
  for (int64_t r = 0; r < nr; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 w[kBlock / 8];  // the block's 32 weights as floats, converted once for every row
    for (int64_t j = 0; j < kBlock / 8; ++j) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + b * kBlock + j * 8));
      w[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    }
    const __m256 s = _mm256_set1_ps(scale[b]);
    for (int64_t r = 0; r < nr; ++r) {
      const float* xb = x + r * in + b * kBlock;
      __m256 dot = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
      for (int64_t j = 1; j < kBlock / 8; ++j) dot = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + j * 8), dot);
      acc[r] = _mm256_fmadd_ps(s, dot, acc[r]);
    }
  }
  for (int64_t r = 0; r < nr; ++r) out[r] = hsum(acc[r]);
#else
  for (int64_t r = 0; r < nr; ++r) {
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      float dot = 0.0f;
      for (int64_t j = 0; j < kBlock; ++j) dot += static_cast<float>(q[b * kBlock + j]) * x[r * in + b * kBlock + j];
      acc += scale[b] * dot;
    }
    out[r] = acc;
  }
#endif
}

at::Tensor float_rows(const at::Tensor& x, int64_t in) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "x must be [rows, in] CPU float32");
  TORCH_CHECK(x.size(1) == in, "x has ", x.size(1), " features, the weight takes ", in);
  return x.contiguous();
}

const Q4Block* q4_blocks(const at::Tensor& blocks, int64_t* out, int64_t* in) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be [out, in / 32 * 20] contiguous uint8");
  TORCH_CHECK(blocks.size(1) % kQ4BlockBytes == 0, "a q4 row is a whole number of 20-byte blocks");
  *out = blocks.size(0);
  *in = blocks.size(1) / kQ4BlockBytes * kBlock;
  return reinterpret_cast<const Q4Block*>(blocks.data_ptr<uint8_t>());
}

// Calls `dots(first_output_row, end_output_row, r0, nr)` over every output row and every group
// of up to kMaxRows activation rows. The output rows are handed out to the threads in small
// chunks, not split in equal halves up front: on a host shared with other processes a thread
// may lose its CPU for a while, and the others then take its share instead of waiting for it.
template <typename Dots>
void for_rows(int64_t outputs, int64_t rows, const Dots& dots) {
  const int64_t chunk = kChunkRows;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (outputs + chunk - 1) / chunk));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(chunk); begin < outputs; begin = next.fetch_add(chunk)) {
      const int64_t end = std::min(outputs, begin + chunk);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) dots(begin, end, r0, std::min(kMaxRows, rows - r0));
    }
  });
}

}  // namespace

// x [rows, in] float32, blocks [out, in / 32 * 20] -> x @ W.T [rows, out] float32.
at::Tensor q4_gemv(const at::Tensor& x, const at::Tensor& blocks) {
  int64_t out_features, in;
  const Q4Block* w = q4_blocks(blocks, &out_features, &in);
  const at::Tensor xc = float_rows(x, in);
  const QuantizedRows a = quantize_rows(xc.data_ptr<float>(), xc.size(0), in);
  at::Tensor out = at::empty({xc.size(0), out_features}, x.options());
  float* o = out.data_ptr<float>();
  for_rows(out_features, a.rows, [&](int64_t begin, int64_t end, int64_t r0, int64_t nr) {
    q4_rows(w, a.blocks, begin, end, a, r0, nr, [&](int64_t n, int r, float v) { o[(r0 + r) * out_features + n] = v; });
  });
  return out;
}

// As q4_gemv over a fused [gate; up] weight of 2 * inter rows, giving silu(gate) * up [rows, inter].
at::Tensor q4_gemv_silu_mul(const at::Tensor& x, const at::Tensor& blocks) {
  int64_t out_features, in;
  const Q4Block* w = q4_blocks(blocks, &out_features, &in);
  TORCH_CHECK(out_features % 2 == 0, "a [gate; up] weight has an even number of rows");
  const int64_t inter = out_features / 2;
  const at::Tensor xc = float_rows(x, in);
  const QuantizedRows a = quantize_rows(xc.data_ptr<float>(), xc.size(0), in);
  at::Tensor out = at::empty({xc.size(0), inter}, x.options());
  float* o = out.data_ptr<float>();
  for_rows(inter, a.rows, [&](int64_t begin, int64_t end, int64_t r0, int64_t nr) {
    // The gate rows first, into the output; then the up rows, each multiplied into its place.
    q4_rows(w, a.blocks, begin, end, a, r0, nr, [&](int64_t n, int r, float g) {
      o[(r0 + r) * inter + n] = g / (1.0f + std::exp(-g));
    });
    q4_rows(w + inter * a.blocks, a.blocks, begin, end, a, r0, nr, [&](int64_t n, int r, float u) {
      o[(r0 + r) * inter + n] *= u;
    });
  });
  return out;
}

namespace {
void check_q8(const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q must be [out, in] contiguous int8");
  TORCH_CHECK(q.size(1) % kBlock == 0, "in must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == q.size(0) * (q.size(1) / kBlock),
              "scales must be [out, in / 32] contiguous float32");
}
}  // namespace

// x [rows, in] float32, q [out, in] int8, scales [out, in / 32] float32 -> [rows, out] float32.
at::Tensor q8_gemv(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check_q8(q, scales);
  const int64_t out_features = q.size(0), in = q.size(1);
  const at::Tensor xc = float_rows(x, in);
  const QuantizedRows a = quantize_rows(xc.data_ptr<float>(), xc.size(0), in);
  at::Tensor out = at::empty({xc.size(0), out_features}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for_rows(out_features, a.rows, [&](int64_t begin, int64_t end, int64_t r0, int64_t nr) {
    float dots[kMaxRows];
    for (int64_t n = begin; n < end; ++n) {
      q8_row_dots(qp + n * in, sp + n * a.blocks, a, r0, nr, dots);
      for (int64_t r = 0; r < nr; ++r) o[(r0 + r) * out_features + n] = dots[r];
    }
  });
  return out;
}

// As q8_gemv with x's rows not rounded to int8 (float32 products throughout).
at::Tensor q8_gemv_exact(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check_q8(q, scales);
  const int64_t out_features = q.size(0), in = q.size(1);
  const at::Tensor xc = float_rows(x, in);
  at::Tensor out = at::empty({xc.size(0), out_features}, x.options());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for_rows(out_features, xc.size(0), [&](int64_t begin, int64_t end, int64_t r0, int64_t nr) {
    float dots[kMaxRows];
    for (int64_t n = begin; n < end; ++n) {
      q8_row_dots_exact(qp + n * in, sp + n * (in / kBlock), xp + r0 * in, in, nr, dots);
      for (int64_t r = 0; r < nr; ++r) o[(r0 + r) * out_features + n] = dots[r];
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(disagg_cpu, m) {
  m.def("q4_gemv(Tensor x, Tensor blocks) -> Tensor");
  m.def("q4_gemv_silu_mul(Tensor x, Tensor blocks) -> Tensor");
  m.def("q8_gemv(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("q8_gemv_exact(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(disagg_cpu, CPU, m) {
  m.impl("q4_gemv", &q4_gemv);
  m.impl("q4_gemv_silu_mul", &q4_gemv_silu_mul);
  m.impl("q8_gemv", &q8_gemv);
  m.impl("q8_gemv_exact", &q8_gemv_exact);
}
