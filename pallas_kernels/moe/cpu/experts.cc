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
// The GEMM: C[m, n] = sum_k A[m, k] B[k, n] with A the gathered rows [M, K] and B an expert's weight [K, N], both
// row major as stored. With AVX-512 BF16, a 32-column strip of B is read two rows (k, k + 1) at a time and
// interleaved into the (k, k + 1) pairs `vdpbf16ps` multiplies (its lane order is undone when the strip is stored);
// from kPackRows rows up, B is first repacked so (`Pack`). Without AVX-512 BF16, a plain f32 loop over the same k.

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_ffi.h"

namespace {

using namespace jaxhybrid_cpu;  // NOLINT: the kernels' shared vocabulary

using Bf16Buffer = ffi::Buffer<ffi::BF16>;
using Bf16Result = ffi::ResultBuffer<ffi::BF16>;

constexpr int64_t kRowBlock = 32;  // rows per block of an expert's rows (the most one GEMM call sees)
constexpr int kTileRows = 8;       // rows per register tile: 16 accumulators
constexpr int64_t kStrip = 32;     // columns per register tile

enum Activation : int32_t { kSiluGated = 0, kRelu2 = 1 };

inline float ToFloat(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as XLA's f32 -> bf16 convert (NaN stays NaN).
inline uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float RoundBf16(float f) { return ToFloat(ToBf16(f)); }

// An expert's weight B [K, N] as Gemm reads it; `packed` (AVX-512 BF16 only): B repacked once for all its rows.
struct Weight {
  const uint16_t* b;
  int64_t K, N;
  const uint16_t* packed = nullptr;
};

#if defined(__AVX512BF16__)

// The accumulators of a strip hold its columns in the lane order of the pairs: per 128-bit lane L, columns 8L..8L+3
// (`lo`) and 8L+4..8L+7 (`hi`). Storing puts them back in column order.
inline void StoreStrip(__m512 lo, __m512 hi, __mmask32 columns, float* c) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_mask_storeu_ps(c, static_cast<__mmask16>(columns), _mm512_permutex2var_ps(lo, first, hi));
  _mm512_mask_storeu_ps(c + 16, static_cast<__mmask16>(columns >> 16), _mm512_permutex2var_ps(lo, second, hi));
}

inline __mmask32 ColumnMask(int64_t width) { return width >= kStrip ? ~__mmask32{0} : (__mmask32{1} << width) - 1; }

// B's rows k and k + 1 in one strip, interleaved into (k, k + 1) pairs: the `lo` and `hi` halves.
inline void Pairs(const uint16_t* row0, const uint16_t* row1, __mmask32 columns, __m512i* lo, __m512i* hi) {
  const __m512i r0 = _mm512_maskz_loadu_epi16(columns, row0), r1 = _mm512_maskz_loadu_epi16(columns, row1);
  *lo = _mm512_unpacklo_epi16(r0, r1);
  *hi = _mm512_unpackhi_epi16(r0, r1);
}

// One strip of C: rows [0, M) of A against the strip's pairs of B rows, `pairs_at(k, &lo, &hi)` for rows k, k + 1.
template <int M, typename PairsAt>
void Strip(const uint16_t* a, int64_t lda, int64_t K, const PairsAt& pairs_at, __mmask32 columns, float* c,
           int64_t ldc) {
  __m512 lo[M], hi[M];
  for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512i pl, ph;
    pairs_at(k, &pl, &ph);
    for (int m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * lda + k, sizeof pair);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      lo[m] = _mm512_dpbf16_ps(lo[m], av, (__m512bh)pl);
      hi[m] = _mm512_dpbf16_ps(hi[m], av, (__m512bh)ph);
    }
  }
  for (int m = 0; m < M; ++m) StoreStrip(lo[m], hi[m], columns, c + m * ldc);
}

// B [K, N] as strips of 32 columns, each its K / 2 pairs of rows in a row (64 values a pair): read once, in order,
// instead of walking B's rows strip by strip (one cache line per row, 2N bytes apart) for every tile of rows.
void Pack(const uint16_t* b, int64_t K, int64_t N, uint16_t* packed) {
  const int64_t strips = (N + kStrip - 1) / kStrip;
  for (int64_t k = 0; k < K; k += 2) {
    for (int64_t s = 0; s < strips; ++s) {
      __m512i lo, hi;
      Pairs(b + k * N + s * kStrip, b + (k + 1) * N + s * kStrip, ColumnMask(N - s * kStrip), &lo, &hi);
      uint16_t* dst = packed + (s * K + k) * kStrip;
      _mm512_storeu_si512(dst, lo);
      _mm512_storeu_si512(dst + kStrip, hi);
    }
  }
}

template <int M>
void Tile(const uint16_t* a, int64_t K, const uint16_t* b, const uint16_t* packed, int64_t N, float* c) {
  for (int64_t n = 0; n < N; n += kStrip) {
    const __mmask32 columns = ColumnMask(N - n);
    if (packed != nullptr) {
      const uint16_t* strip = packed + n * K;
      auto at = [strip](int64_t k, __m512i* lo, __m512i* hi) {
        *lo = _mm512_loadu_si512(strip + k * kStrip);
        *hi = _mm512_loadu_si512(strip + k * kStrip + kStrip);
      };
      Strip<M>(a, K, K, at, columns, c + n, N);
    } else {
      auto at = [b, n, N, columns](int64_t k, __m512i* lo, __m512i* hi) {
        Pairs(b + k * N + n, b + (k + 1) * N + n, columns, lo, hi);
      };
      Strip<M>(a, K, K, at, columns, c + n, N);
    }
  }
}

// Rows from which packing B first pays: below, each strip's rows are read once anyway.
constexpr int64_t kPackRows = 3;

// B ready for `rows` rows: packed into `buffer` from kPackRows rows up.
Weight Prepare(const uint16_t* b, int64_t K, int64_t N, int64_t rows, std::vector<uint16_t>& buffer) {
  if (rows < kPackRows) return {b, K, N};
  buffer.resize((N + kStrip - 1) / kStrip * kStrip * K);
  Pack(b, K, N, buffer.data());
  return {b, K, N, buffer.data()};
}

// C[M, N] = A[M, K] B[K, N] in f32, K even.
void Gemm(const uint16_t* a, int64_t M, const Weight& w, float* c) {
  using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, float*);
  static constexpr TileFn kTiles[kTileRows] = {Tile<1>, Tile<2>, Tile<3>, Tile<4>, Tile<5>, Tile<6>, Tile<7>, Tile<8>};
  for (int64_t m = 0; m < M; m += kTileRows) {
    kTiles[std::min<int64_t>(kTileRows, M - m) - 1](a + m * w.K, w.K, w.b, w.packed, w.N, c + m * w.N);
  }
}

#else

Weight Prepare(const uint16_t* b, int64_t K, int64_t N, int64_t, std::vector<uint16_t>&) { return {b, K, N}; }

// C[M, N] = A[M, K] B[K, N] in f32, K even: the same order of k, in plain f32 arithmetic.
void Gemm(const uint16_t* a, int64_t M, const Weight& w, float* c) {
  const int64_t K = w.K, N = w.N;
  std::fill(c, c + M * N, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    float* row = c + m * N;
    for (int64_t k = 0; k < K; k += 2) {
      const float a0 = ToFloat(a[m * K + k]), a1 = ToFloat(a[m * K + k + 1]);
      for (int64_t n = 0; n < N; ++n) row[n] += a0 * ToFloat(w.b[k * N + n]) + a1 * ToFloat(w.b[(k + 1) * N + n]);
    }
  }
}

#endif

// The element-wise work, over n values: the activation of the projections' f32 accumulators (rounded to bf16
// first) into bf16 hidden values; the down projection's accumulators rounded to bf16; a token's weighted sum. The
// SiLU is jax.nn.silu in bf16 as XLA evaluates it: g * (1 / (1 + e^-g)), each op rounded to bf16.
#if defined(__AVX512BF16__)

inline __mmask16 Lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

inline __m256i PackBf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

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

void StoreBf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = Lanes(n - i);
    _mm256_mask_storeu_epi16(out + i, lanes, PackBf16(_mm512_maskz_loadu_ps(lanes, x + i)));
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

void StoreBf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = ToBf16(x[i]);
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
  const std::vector<int64_t> routing{s.tokens, s.top_k}, stacked{s.experts, s.dim, s.inter};
  bool ok = dims(x) == std::vector<int64_t>{s.tokens, s.dim} && dims(weights) == routing && dims(ids) == routing &&
            dims(up) == stacked && dims(gate) == stacked &&
            dims(down) == std::vector<int64_t>{s.experts, s.inter, s.dim} && s.dim % 2 == 0 && s.inter % 2 == 0;
  return ok ? ffi::Error::Success()
            : ffi::Error::InvalidArgument("routed_experts: inconsistent shapes (or an odd width)");
}

ffi::Error RoutedExpertsImpl(ffi::ThreadPool pool, Bf16Buffer x, F32Buffer weights, I32Buffer expert_ids,
                             Bf16Buffer up, Bf16Buffer gate, Bf16Buffer down, Bf16Result out, int32_t activation) {
  const auto xd = x.dimensions(), ud = up.dimensions(), wd = weights.dimensions();
  if (xd.size() != 2 || ud.size() != 3 || wd.size() != 2) {
    return ffi::Error::InvalidArgument("routed_experts: x [T, d], weights [T, k], experts [E, d, I]");
  }
  const Shape s{xd[0], wd[1], ud[0], ud[1], ud[2]};
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
    thread_local std::vector<uint16_t> packed[3];
    const Weight w_up = Prepare(upp + e * D * I, D, I, count, packed[0]);
    const Weight w_gate = activation == kSiluGated ? Prepare(gatep + e * D * I, D, I, count, packed[1]) : w_up;
    const Weight w_down = Prepare(downp + e * I * D, I, D, count, packed[2]);
    uint16_t* rows = reinterpret_cast<uint16_t*>(floats);
    uint16_t* hidden = rows + kRowBlock * D;
    float* acc_up = floats + kRowBlock * (D + I) / 2;
    float* acc_gate = acc_up + kRowBlock * I;
    float* acc_down = acc_gate + kRowBlock * I;
    for (int64_t first = 0; first < count; first += kRowBlock) {
      const int64_t M = std::min(kRowBlock, count - first);
      for (int64_t m = 0; m < M; ++m) std::memcpy(rows + m * D, xp + routed[e][first + m] / s.top_k * D, D * 2);
      Gemm(rows, M, w_up, acc_up);
      if (activation == kSiluGated) Gemm(rows, M, w_gate, acc_gate);
      Activate(acc_up, acc_gate, M * I, activation, hidden);
      Gemm(hidden, M, w_down, acc_down);
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
                                  .Arg<Bf16Buffer>()  // up [E, d, I]
                                  .Arg<Bf16Buffer>()  // gate [E, d, I] (up again without a gate)
                                  .Arg<Bf16Buffer>()  // down [E, I, d]
                                  .Ret<Bf16Buffer>()  // out [T, d]
                                  .Attr<int32_t>("activation"));
