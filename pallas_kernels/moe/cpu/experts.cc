// Routed experts on CPU, bf16, as an XLA FFI handler (docs/kernels.md#routed-experts-on-cpu).
//
// XLA:CPU multiplies the routed rows through layouts of static shape: `capacity` rows per expert (mostly padding
// when a few tokens decode: 12 rows per expert for 16 tokens of top-2 among 8 experts), or one-expert tiles with
// their weights gathered. Here each expert multiplies exactly the rows routed to it, straight from the stacked
// weights, and the activation runs on the accumulator tile before the down projection.
//
// Rounding follows the reference (pallas_kernels/moe/reference.py): each projection accumulates in f32 and is
// rounded to bf16; the activation rounds after each of its element-wise ops, as XLA evaluates bf16 element-wise
// ops; each assignment's output is weighted in f32 and a token's k outputs summed in f32 in routing order, then
// rounded to bf16.
//
// The GEMMs are the shared bf16 ones (bf16_gemm.h), on experts packed ahead of time ([E, out / 32, in / 2, 32, 2]).

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16_gemm.h"
#include "cpu_ffi.h"

namespace {

using namespace jaxhybrid_cpu;  // NOLINT: the kernels' shared vocabulary
using jaxhybrid_cpu::RoundBf16;  // beside the vector overload below

using Bf16Buffer = ffi::Buffer<ffi::BF16>;
using Bf16Result = ffi::ResultBuffer<ffi::BF16>;

constexpr int64_t kRowBlock = 32;  // rows per block of an expert's rows (the most one GEMM call sees)
enum Activation : int32_t { kSiluGated = 0, kRelu2 = 1 };

// The element-wise work, over n values: the activation of the projections' f32 accumulators (rounded to bf16
// first) into bf16 hidden values; a token's weighted sum. The
// SiLU is jax.nn.silu in bf16 as XLA evaluates it: g * (1 / (1 + e^-g)), each op rounded to bf16.
#if defined(__AVX512BF16__)

inline __m512 RoundBf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(PackBf16(x)), 16));
}

// e^x to about 1 f32 ulp: 2^n e^r, |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial (error < 1e-8).
inline __m512 Exp(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-120.0f)), _mm512_set1_ps(120.0f));  // 2^n saturates beyond
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln 2 in two parts: n ln2_hi is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
}

void Activate(const float* up, const float* gate, int64_t n, int32_t activation, uint16_t* hidden) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = Lanes(n - i);
    const __m512 u = RoundBf16(_mm512_maskz_loadu_ps(lanes, up + i));
    __m512 h;
    if (activation == kSiluGated) {
      const __m512 g = RoundBf16(_mm512_maskz_loadu_ps(lanes, gate + i));
      const __m512 denominator = RoundBf16(_mm512_add_ps(one, RoundBf16(Exp(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
      const __m512 silu = RoundBf16(_mm512_mul_ps(g, RoundBf16(_mm512_div_ps(one, denominator))));
      h = _mm512_mul_ps(silu, u);
    } else {
      const __m512 relu = _mm512_max_ps(u, _mm512_setzero_ps());
      h = _mm512_mul_ps(relu, relu);
    }
    _mm256_mask_storeu_epi16(hidden + i, lanes, PackBf16(h));
  }
}

// out[j] = bf16(sum_c weight[c] results[c][j]), the k terms added in order from 0.
void WeightedSum(const float* weight, const uint16_t* results, int64_t k, int64_t n, uint16_t* out) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = Lanes(n - j);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < k; ++c) {
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, results + c * n + j));
      const __m512 result = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_set1_ps(weight[c]), result));
    }
    _mm256_mask_storeu_epi16(out + j, lanes, PackBf16(sum));
  }
}

#else

float Silu(float g) {
  const float denominator = RoundBf16(1.0f + RoundBf16(std::exp(-g)));
  return RoundBf16(g * RoundBf16(1.0f / denominator));
}

void Activate(const float* up, const float* gate, int64_t n, int32_t activation, uint16_t* hidden) {
  for (int64_t i = 0; i < n; ++i) {
    const float u = RoundBf16(up[i]);
    const float relu = u > 0.0f ? u : 0.0f;
    hidden[i] = ToBf16(activation == kSiluGated ? Silu(RoundBf16(gate[i])) * u : relu * relu);
  }
}

void WeightedSum(const float* weight, const uint16_t* results, int64_t k, int64_t n, uint16_t* out) {
  for (int64_t j = 0; j < n; ++j) {
    float sum = 0.0f;
    for (int64_t c = 0; c < k; ++c) sum += weight[c] * ToFloat(results[c * n + j]);
    out[j] = ToBf16(sum);
  }
}

#endif

struct Shape {
  int64_t tokens, top_k, experts, dim, inter;
};

ffi::Error CheckShape(const Shape& s, const Bf16Buffer& x, const F32Buffer& weights, const I32Buffer& ids,
                      const Bf16Buffer& up, const Bf16Buffer& gate, const Bf16Buffer& down) {
  auto dims = [](const auto& b) { return std::vector<int64_t>(b.dimensions().begin(), b.dimensions().end()); };
  // packed [E, out / 32, in / 2, 32, 2]
  auto packed = [&s](int64_t in, int64_t out) {
    return std::vector<int64_t>{s.experts, out / kStrip, in / 2, kStrip, 2};
  };
  const std::vector<int64_t> routing{s.tokens, s.top_k}, stacked = packed(s.dim, s.inter);
  bool ok = dims(x) == std::vector<int64_t>{s.tokens, s.dim} && dims(weights) == routing && dims(ids) == routing &&
            dims(up) == stacked && dims(gate) == stacked && dims(down) == packed(s.inter, s.dim) &&
            s.dim % kStrip == 0 && s.inter % kStrip == 0;
  return ok ? ffi::Error::Success()
            : ffi::Error::InvalidArgument("routed_experts: inconsistent shapes (experts packed [E, out / 32, in / 2, "
                                          "32, 2], widths multiples of 32)");
}

ffi::Error RoutedExpertsImpl(ffi::ThreadPool pool, Bf16Buffer x, F32Buffer weights, I32Buffer expert_ids,
                             Bf16Buffer up, Bf16Buffer gate, Bf16Buffer down, Bf16Result out, int32_t activation) {
  const auto xd = x.dimensions(), ud = up.dimensions(), wd = weights.dimensions();
  if (xd.size() != 2 || ud.size() != 5 || wd.size() != 2) {
    return ffi::Error::InvalidArgument("routed_experts: x [T, d], weights [T, k], experts packed [E, ...]");
  }
  const Shape s{xd[0], wd[1], ud[0], xd[1], ud[1] * kStrip};
  if (auto error = CheckShape(s, x, weights, expert_ids, up, gate, down); error.failure()) return error;
  if (activation != kSiluGated && activation != kRelu2) {
    return ffi::Error::InvalidArgument("routed_experts: unknown activation");
  }
  const int64_t assignments = s.tokens * s.top_k, D = s.dim, I = s.inter;
  const int32_t* ids = expert_ids.typed_data();
  // each expert's assignments, in routing order
  std::vector<std::vector<int64_t>> routed(s.experts);
  for (int64_t i = 0; i < assignments; ++i) {
    if (ids[i] < 0 || ids[i] >= s.experts) return ffi::Error::InvalidArgument("routed_experts: expert id outside [0, E)");
    routed[ids[i]].push_back(i);
  }
  std::vector<int64_t> items;  // the experts with rows
  for (int64_t e = 0; e < s.experts; ++e) {
    if (!routed[e].empty()) items.push_back(e);
  }
  std::vector<uint16_t> results(assignments * D);  // each assignment's expert output, bf16
  const uint16_t *xp = x.typed_data(), *upp = up.typed_data(), *gatep = gate.typed_data();
  const uint16_t* downp = down.typed_data();
  // scratch: a block's rows and activations (bf16, as halves of floats), its three f32 accumulators
  const size_t scratch = kRowBlock * (D + I) / 2 + kRowBlock * (2 * I + D);

  auto work = [&](int64_t item, float* floats) {
    const int64_t e = items[item], count = routed[e].size();
    const Packed w_up{upp + e * D * I, D, I}, w_gate{gatep + e * D * I, D, I}, w_down{downp + e * I * D, I, D};
    uint16_t* rows = reinterpret_cast<uint16_t*>(floats);
    uint16_t* hidden = rows + kRowBlock * D;
    float* acc_up = floats + kRowBlock * (D + I) / 2;
    float* acc_gate = acc_up + kRowBlock * I;
    float* acc_down = acc_gate + kRowBlock * I;
    for (int64_t first = 0; first < count; first += kRowBlock) {
      const int64_t M = std::min(kRowBlock, count - first);
      for (int64_t m = 0; m < M; ++m) std::memcpy(rows + m * D, xp + routed[e][first + m] / s.top_k * D, D * 2);
      Gemm(rows, M, w_up, acc_up, I);
      if (activation == kSiluGated) Gemm(rows, M, w_gate, acc_gate, I);
      Activate(acc_up, acc_gate, M * I, activation, hidden);
      Gemm(hidden, M, w_down, acc_down, D);
      for (int64_t m = 0; m < M; ++m) StoreBf16(acc_down + m * D, D, results.data() + routed[e][first + m] * D);
    }
  };
  ParallelFor(pool, static_cast<int64_t>(items.size()), 2 * kRowBlock * D * I, scratch, work);

  const float* w = weights.typed_data();
  for (int64_t t = 0; t < s.tokens; ++t) {
    WeightedSum(w + t * s.top_k, results.data() + t * s.top_k * D, s.top_k, D, out->typed_data() + t * D);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxhybridRoutedExperts, RoutedExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bf16Buffer>()  // x [T, d]
                                  .Arg<F32Buffer>()   // weights [T, k]
                                  .Arg<I32Buffer>()   // experts [T, k]
                                  .Arg<Bf16Buffer>()  // up, packed [E, I / 32, d / 2, 32, 2]
                                  .Arg<Bf16Buffer>()  // gate, as up (up again without a gate)
                                  .Arg<Bf16Buffer>()  // down, packed [E, d / 32, I / 2, 32, 2]
                                  .Ret<Bf16Buffer>()  // out [T, d]
                                  .Attr<int32_t>("activation"));
