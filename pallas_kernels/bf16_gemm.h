// The bf16 GEMM the CPU FFI kernels share (docs/kernels.md#bf16-matmuls-on-cpu): C[M, N] = A[M, K] B[K, N] with
// f32 accumulation, A row major, B packed ahead of time (pallas_kernels/matmul/cpu: `pack`).
//
// The packed form is the order `vdpbf16ps` multiplies in: strips of 32 columns, each its K / 2 pairs of rows
// (k, k + 1) one after the other, a pair's 64 values column by column (B[k][n], B[k + 1][n], B[k][n + 1], ...):
// element [s][k / 2][c][k % 2] is B[k][32 s + c]. A strip then streams from memory in order, once, and its
// accumulators hold its columns in order. With AVX-512 BF16 a register tile is up to kTileRows rows of A against
// one strip; without it, a plain f32 loop over the same k.
#ifndef JAXHYBRID_PALLAS_KERNELS_BF16_GEMM_H_
#define JAXHYBRID_PALLAS_KERNELS_BF16_GEMM_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace jaxhybrid_cpu {

constexpr int kTileRows = 8;    // rows per register tile: 16 accumulators
constexpr int64_t kStrip = 32;  // columns per strip, N a multiple of it

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

// B [K, N], packed: N / kStrip strips of K * kStrip values.
struct Packed {
  const uint16_t* b;
  int64_t K, N;
};

#if defined(__AVX512BF16__)

inline __mmask16 Lanes(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

inline __m256i PackBf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

// One strip of C: rows [0, M) of A against the strip's pairs; columns 0-15 accumulate in `lo`, 16-31 in `hi`.
template <int M>
void Strip(const uint16_t* a, int64_t K, const uint16_t* strip, float* c, int64_t ldc) {
  __m512 lo[M], hi[M];
  for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const __m512i pl = _mm512_loadu_si512(strip + k * kStrip), ph = _mm512_loadu_si512(strip + k * kStrip + 16 * 2);
    for (int m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * K + k, sizeof pair);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      lo[m] = _mm512_dpbf16_ps(lo[m], av, (__m512bh)pl);
      hi[m] = _mm512_dpbf16_ps(hi[m], av, (__m512bh)ph);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm512_storeu_ps(c + m * ldc, lo[m]);
    _mm512_storeu_ps(c + m * ldc + 16, hi[m]);
  }
}

// C[M, N] (row stride ldc) = A[M, K] B[K, N] in f32: strip by strip, each against every tile of A's rows (a strip,
// K * 64 bytes, stays in the core's cache through them).
inline void Gemm(const uint16_t* a, int64_t M, const Packed& w, float* c, int64_t ldc) {
  using StripFn = void (*)(const uint16_t*, int64_t, const uint16_t*, float*, int64_t);
  static constexpr StripFn kStrips[kTileRows] = {Strip<1>, Strip<2>, Strip<3>, Strip<4>,
                                                 Strip<5>, Strip<6>, Strip<7>, Strip<8>};
  for (int64_t n = 0; n < w.N; n += kStrip) {
    for (int64_t m = 0; m < M; m += kTileRows) {
      kStrips[std::min<int64_t>(kTileRows, M - m) - 1](a + m * w.K, w.K, w.b + n * w.K, c + m * ldc + n, ldc);
    }
  }
}

inline void StoreBf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = Lanes(n - i);
    _mm256_mask_storeu_epi16(out + i, lanes, PackBf16(_mm512_maskz_loadu_ps(lanes, x + i)));
  }
}

#else

// C[M, N] (row stride ldc) = A[M, K] B[K, N] in f32: the same order of k, in plain f32 arithmetic.
inline void Gemm(const uint16_t* a, int64_t M, const Packed& w, float* c, int64_t ldc) {
  const int64_t K = w.K;
  auto at = [&w, K](int64_t k, int64_t n) {  // B[k][n]
    return ToFloat(w.b[((n / kStrip) * K + k - k % 2) * kStrip + n % kStrip * 2 + k % 2]);
  };
  for (int64_t m = 0; m < M; ++m) {
    float* row = c + m * ldc;
    std::fill(row, row + w.N, 0.0f);
    for (int64_t k = 0; k < K; k += 2) {
      const float a0 = ToFloat(a[m * K + k]), a1 = ToFloat(a[m * K + k + 1]);
      for (int64_t n = 0; n < w.N; ++n) row[n] += a0 * at(k, n) + a1 * at(k + 1, n);
    }
  }
}

inline void StoreBf16(const float* x, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = ToBf16(x[i]);
}

#endif

}  // namespace jaxhybrid_cpu

#endif  // JAXHYBRID_PALLAS_KERNELS_BF16_GEMM_H_
